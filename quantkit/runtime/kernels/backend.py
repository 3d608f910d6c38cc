"""Whether the Triton kernels in this package can run here (cheap to import: no triton, no CUDA init)."""

from __future__ import annotations

import importlib.util
import os


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    """True when there is a CUDA device (or the interpreter is enabled) and triton imports; triton is imported
    only then (it is the optional ``gpu`` extra: without it the runtime runs its torch backend).

    Note: ``TRITON_INTERPRET`` must be set before triton is first imported for the interpreter to take effect.
    """
    if not interpreter_enabled():
        import torch

        if not torch.cuda.is_available():
            return False
    try:
        if importlib.util.find_spec("triton") is None:
            return False
        import triton  # noqa: F401
    except Exception:  # a broken install (missing libs, ABI mismatch) means "not available"
        return False
    return True
