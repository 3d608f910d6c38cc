"""quantkit: offline quantization and compression for Hugging Face causal LMs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from quantkit.runtime.llm import LLM
    from quantkit.runtime.sampling_params import SamplingParams

_LAZY = {"LLM": "quantkit.runtime.llm", "SamplingParams": "quantkit.runtime.sampling_params"}


def __getattr__(name: str) -> Any:
    """Import the runtime only when ``quantkit.LLM`` / ``quantkit.SamplingParams`` is first used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
