"""Optional extras: which extra provides which module, and the one line a user sees when one is missing.

The core install (``pip install -e .``) runs calibrate, quantize, eval, inspect, sensitivity, plan, export, bench
and recipes without a smoke stage. The rest needs an extra (pyproject.toml's ``optional-dependencies``):

- ``serve``: FastAPI + uvicorn (and httpx, the client of ``quantkit smoke``): ``quantkit serve``, ``quantkit
  smoke``, a recipe's smoke stage;
- ``plot``: matplotlib: ``quantkit plan --plot``, the plots of a recipe's report (skipped with a note without it);
- ``gpu``: triton: the Triton kernels, imported only when a CUDA device is there (or ``TRITON_INTERPRET=1``); the
  runtime falls back to its torch backend without it;
- ``data``: rdata: ``tools/build_corpus.py`` (reads R data files).

This table is the one place that knows it: the CLI turns a ``ModuleNotFoundError`` of a module listed here into
one line naming the extra (exit 2), and a recipe checks its stages' extras before its first stage.
"""

from __future__ import annotations

import importlib.util

from quantkit.errors import QuantkitError

EXTRAS: dict[str, tuple[str, ...]] = {  # extra -> the top-level modules it provides (import names)
    "serve": ("fastapi", "uvicorn", "starlette", "httpx"),
    "plot": ("matplotlib",),
    "gpu": ("triton",),
    "data": ("rdata",),
}


def install_command(extra: str) -> str:
    """What to run to get ``extra`` (works for an editable install too: pip keeps it and adds the extra's deps)."""
    return f"pip install 'quantkit[{extra}]'"


def extra_for_module(module: str | None) -> str | None:
    """The extra that provides ``module`` (a dotted name: its top level counts), or None for any other module."""
    if not module:
        return None
    top = module.partition(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that are not installed here (found without importing them)."""
    missing = []
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
            found = False
        if not found:
            missing.append(module)
    return missing


class MissingExtraError(QuantkitError):
    """An optional dependency is not installed; the message names the extra and the command that installs it."""

    def __init__(self, extra: str, module: str, needed_by: str | None = None, otherwise: str | None = None) -> None:
        self.extra = extra
        self.module = module
        who = f"{needed_by} needs" if needed_by else "this needs"
        alternative = f", or {otherwise}" if otherwise else ""
        super().__init__(
            f"{who} the '{extra}' extra ({module} is not installed); install it with: "
            f"{install_command(extra)}{alternative}"
        )


def require(extra: str, needed_by: str | None = None, otherwise: str | None = None) -> None:
    """Raise :class:`MissingExtraError` when a module of ``extra`` is not installed."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(extra, missing[0], needed_by, otherwise)


def missing_extra_error(exc: ImportError, needed_by: str | None = None) -> MissingExtraError | None:
    """``exc`` as a :class:`MissingExtraError` when it is a module of an extra that is missing, else None."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    extra = extra_for_module(exc.name)
    if extra is None:
        return None
    return MissingExtraError(extra, str(exc.name).partition(".")[0], needed_by)
