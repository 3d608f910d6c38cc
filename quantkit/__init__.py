"""quantkit: offline quantization and compression for Hugging Face causal LMs."""

from __future__ import annotations

__version__ = "0.1.0"
