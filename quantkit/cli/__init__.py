"""The ``quantkit`` command line: each command builds one config and calls one library function.

Commands are grouped by concern: :mod:`.offline` (calibrate, quantize, eval, inspect), :mod:`.export`, :mod:`.mixed`
(sensitivity, plan), :mod:`.recipes` (run, recipe validate/new), :mod:`.serving` (serve, smoke) and :mod:`.bench`
(bench).
"""

# registration order is the help's order: the data flow, then serving, then its benchmark
from quantkit.cli import offline  # noqa: I001, F401
from quantkit.cli import export, mixed, recipes, serving  # noqa: F401
from quantkit.cli import bench  # noqa: F401
from quantkit.cli.app import app, main

__all__ = ["app", "main"]
