"""Quantization algorithms, one module each, behind one registry (:mod:`.registry`); how they compose into a job
is :mod:`.composition`. Importing this package registers every algorithm: a new one is a module here and one line
in :data:`ALGORITHM_MODULES`."""

from __future__ import annotations

import importlib

from quantkit.quantization.methods import registry

# In registration order (which orders algorithms of the same role, and the method spellings).
ALGORITHM_MODULES = (
    "rtn",
    "gptq",
    "awq",
    "smoothquant",
    "float_targets",
    "tune",
    "rotation",
    "head_refit",
    "head_quant",
    "embed_quant",
)

for _name in ALGORITHM_MODULES:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["ALGORITHM_MODULES", "registry"]
