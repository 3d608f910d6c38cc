"""Calibrating an FP8 KV cache inside a Hugging Face model: an attention function registered with transformers'
``AttentionInterface`` (wrapping SDPA) measures the largest key and value magnitude per KV head, from which
``k_scale`` / ``v_scale`` are set. The cache's numerics themselves live with the format (``format/kv_cache.py``).

A model runs with an attention function by naming it as its attention implementation for the duration of
:func:`attention_implementation`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from quantkit.format.float_codes import FP8_MAX
from quantkit.format.kv_cache import K_SCALE, V_SCALE, register_fp8_cache, sdpa

OBSERVE = "quantkit_kv_observe"
_ABSMAX = "_quantkit_kv_absmax"  # [2, kv_heads] float32 on the attention module while observing


def _observe(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any):
    """Keys and values are [batch, kv_heads, tokens, head_dim]: the largest magnitude per KV head."""
    seen = torch.stack([key.detach().abs().amax(dim=(0, 2, 3)), value.detach().abs().amax(dim=(0, 2, 3))]).float()
    previous = getattr(module, _ABSMAX, None)
    setattr(module, _ABSMAX, seen if previous is None else torch.maximum(previous, seen))
    return sdpa(module, query, key, value, *args, **kw)


def register() -> None:
    """Make the observer and the FP8 cache known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(OBSERVE, _observe)
    register_fp8_cache()


@contextmanager
def attention_implementation(attention: nn.Module, name: str) -> Iterator[None]:
    """Run ``attention`` (a model's attention module; its config is usually the whole model's) with attention
    function ``name``, restoring the previous one afterwards."""
    register()
    config = attention.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def take_kv_absmax(attention: nn.Module) -> torch.Tensor:
    """[2, kv_heads] float32: the keys' and values' largest magnitude per KV head seen since the last call."""
    found = getattr(attention, _ABSMAX, None)
    if found is None:
        raise RuntimeError("the attention did not run while its key/value ranges were observed")
    delattr(attention, _ABSMAX)
    return found


def kv_scales(absmax: torch.Tensor, per_head: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``k_scale`` / ``v_scale`` as stored beside the attention (``absmax / 448`` in the model's dtype): [1] per
    layer, or [kv_heads, 1, 1] per KV head (compressed-tensors' ``attn_head`` strategy)."""
    tiny = torch.finfo(torch.float32).tiny
    out = {}
    for name, row in zip((K_SCALE, V_SCALE), absmax, strict=True):
        scale = (row if per_head else row.amax().reshape(1)).clamp(min=tiny) / FP8_MAX
        out[name] = (scale.reshape(-1, 1, 1) if per_head else scale).to(dtype)
    return out
