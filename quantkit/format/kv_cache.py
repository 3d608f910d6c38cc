"""An FP8 KV cache as a compressed-tensors checkpoint stores it (``k_scale`` / ``v_scale`` beside every attention)
and as the serving engine computes it: keys (after the rotary embedding) and values (as projected) pass through FP8
under the stored scales before attending, as vLLM's ``--kv-cache-dtype fp8`` does. Inside a Hugging Face model this is
an attention function registered with transformers' ``AttentionInterface`` that wraps SDPA."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from quantkit.format.float_codes import FP8_MAX
from quantkit.format.scheme import KVCacheScheme

FP8_CACHE = "quantkit_kv_fp8"
K_SCALE, V_SCALE = "k_scale", "v_scale"
KV_SCALES = (K_SCALE, V_SCALE)


def sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any):
    """transformers' own SDPA attention (imported late: transformers is heavy)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, *args, **kw)


def quantize_kv(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 codes of keys or values under ``scale`` (broadcast against ``states``): what the cache stores."""
    return (states.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fake_quantize_kv(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keys or values [batch, kv_heads, tokens, head_dim] through FP8 under ``scale`` ([1] or [kv_heads, 1, 1])."""
    s = scale.float().to(states.device)
    s = s.reshape(1, -1, 1, 1) if s.numel() > 1 else s.reshape(1)
    return (quantize_kv(states, s).float() * s).to(states.dtype)


def _fp8_cache(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any):
    key = fake_quantize_kv(key, getattr(module, K_SCALE))
    value = fake_quantize_kv(value, getattr(module, V_SCALE))
    return sdpa(module, query, key, value, *args, **kw)


def register_fp8_cache() -> None:
    """Make the FP8-cache attention known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FP8_CACHE, _fp8_cache)


def add_kv_scale_buffers(model: nn.Module, kv_cache: KVCacheScheme, stored: Mapping[str, torch.dtype]) -> int:
    """Empty ``k_scale`` / ``v_scale`` buffers on every attention the checkpoint stores them for (found from the
    stored names, so no architecture table is needed), shaped as ``kv_cache``'s strategy stores them. Returns how
    many attentions got them."""
    heads = model.config.num_key_value_heads
    shape = (heads, 1, 1) if kv_cache.strategy == "attn_head" else (1,)
    owners = sorted({key.rsplit(".", 1)[0] for key in stored if key.endswith(tuple("." + n for n in KV_SCALES))})
    for owner in owners:
        attention = model.get_submodule(owner)
        for name in KV_SCALES:
            dtype = stored.get(f"{owner}.{name}", torch.bfloat16)
            attention.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))
    return len(owners)


def use_fp8_cache(model: nn.Module) -> None:
    """Run ``model``'s attention through the FP8 cache from now on."""
    register_fp8_cache()
    model.config._attn_implementation = FP8_CACHE
