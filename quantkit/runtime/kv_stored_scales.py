"""An FP8 KV cache under a checkpoint's calibrated scales (compressed-tensors' ``kv_cache_scheme``: ``k_scale`` and
``v_scale`` beside every attention, ``[1]`` per layer or ``[kv_heads, 1, 1]`` per KV head), as vLLM's
``--kv-cache-dtype fp8`` computes it: every key (after the rotary embedding) and value row is stored as
``e4m3(x / scale)`` and read back as ``code * scale`` in float32, the numbers the format loader's
:func:`quantkit.format.kv_cache.fake_quantize_kv` attends with.

The scales are loaded as buffers of each attention (their names are the checkpoint's) and handed to the cache
(:class:`quantkit.runtime.kv_cache.KVCache`), which then keeps no scale per row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.format.kv_cache import K_SCALE, KV_SCALES, V_SCALE, quantize_kv

STORED_CACHE_DTYPE = "fp8"  # the kv_cache_dtype a cache under stored scales is


def resolve_kv_cache_dtype(kv_cache_dtype: str, stored: bool) -> str:
    """The cache's storage for a model with (``stored``) or without the checkpoint's KV scales: a checkpoint that
    calibrates an FP8 cache is served in it ("auto" or "fp8"); int8 would discard its scales."""
    if not stored:
        return kv_cache_dtype
    if kv_cache_dtype not in ("auto", STORED_CACHE_DTYPE):
        raise QuantkitError(
            f"the checkpoint calibrates an FP8 KV cache (its kv_cache_scheme) and kv_cache_dtype={kv_cache_dtype!r} "
            "would discard its scales; use kv_cache_dtype 'auto' or 'fp8'"
        )
    return STORED_CACHE_DTYPE


def register_kv_scale_buffers(
    attentions: Sequence[tuple[str, nn.Module]], state: Mapping[str, torch.Tensor], num_kv_heads: int
) -> None:
    """Empty (meta) ``k_scale`` / ``v_scale`` buffers on every attention, shaped and typed as the checkpoint stores
    them, so that loading the state fills them; an attention without them, or scales neither per layer nor per KV
    head, is an error naming the tensor."""
    for name, attention in attentions:
        for part in KV_SCALES:
            key = f"{name}.{part}"
            stored = state.get(key)
            if stored is None:
                raise QuantkitError(
                    f"checkpoint tensor {key!r} is missing: the quantization_config names a kv_cache_scheme, so "
                    "every attention stores k_scale and v_scale; re-export the checkpoint"
                )
            if stored.numel() not in (1, num_kv_heads):
                raise QuantkitError(
                    f"checkpoint tensor {key!r} holds {stored.numel()} scales; an FP8 KV cache takes one per layer or "
                    f"one per KV head ({num_kv_heads})"
                )
            attention.register_buffer(part, torch.empty(stored.shape, dtype=stored.dtype, device="meta"))


def stored_kv_scales(attentions: Sequence[nn.Module], num_kv_heads: int) -> torch.Tensor | None:
    """Every layer's stored scales as float32 ``[2, L, Hkv]`` (K then V; a per-layer scale repeated over the heads,
    which quantizes every head alike), or None when the checkpoint has none."""
    if not attentions or not hasattr(attentions[0], K_SCALE):
        return None
    per_part = [
        torch.stack([getattr(a, part).float().reshape(-1).expand(num_kv_heads) for a in attentions])
        for part in (K_SCALE, V_SCALE)
    ]
    return torch.stack(per_part)


def write_under_stored_scales(
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k``/``v [T, Hkv, D]`` as FP8 codes under per-head ``scales`` (float32 ``[Hkv]``) at flat slots of
    ``caches [N, bs, Hkv, D]`` (float8_e4m3fn)."""
    for x, cache, scale in zip((k, v), caches, scales, strict=True):
        codes = quantize_kv(x, scale[:, None].float())
        heads, dim = cache.shape[2], cache.shape[3]
        # through uint8 views: index_copy_ has no float8 kernel on CPU
        cache.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slot_mapping, codes.view(torch.uint8))
