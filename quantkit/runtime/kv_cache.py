"""The paged KV cache: allocation, byte accounting, and 8-bit storage (``kv_cache_dtype`` "int8" / "fp8").

``"auto"`` keeps keys and values in the compute dtype with no scales (the cache is exactly what it was before
8-bit storage existed). ``"int8"`` / ``"fp8"`` store every K and V row in 8 bits with ONE float16 scale per
(token slot, kv head) for K and one for V:

* int8, symmetric: ``scale = absmax / 127``, ``q = round(x / scale)`` (half away from zero) in [-127, 127];
* fp8: ``torch.float8_e4m3fn``, ``scale = absmax / 448``, ``q = e4m3(x / scale)`` (round to nearest even).

Why per (token, head): the scale is computed by the KV-write path from the token's own row only, so a write
needs no read-modify-write of its block and no earlier token is ever rescaled when a larger value arrives (a
per-block or per-head-over-time scale would need both); prefix-cached blocks therefore stay bit-stable. With
``head_dim`` 64 it costs 2 bytes per 64 values, so 8-bit storage holds 128 / (64 + 2) = 1.94x the tokens of a
bf16 cache (3.9x of fp32) in the same bytes.

Scales are rounded up to float16 (``absmax / qmax`` is clamped to [2^-14, 60000] and multiplied by
``1 + 2^-10`` before the round-to-nearest cast), so ``|x / scale| <= qmax`` holds and nothing clips: int8
round-trip error is at most ``scale / 2`` per element, fp8 error is e4m3's rounding (relative 2^-4, or
``2^-10 * scale`` in its subnormal range). The clamp to the smallest normal float16 keeps a scale's rounding
relative; rows smaller than 127 * 2^-14 (0.0078) then quantize with absolute error <= 2^-15. The Triton
``kv_cache_write`` kernel does the same float32 arithmetic in-kernel.

Reads dequantize ``q * scale`` in float32 and cast to the compute dtype: the torch decode and prefill paths
after gathering pages, the Triton ``paged_attention`` kernel in registers.

Rotated keys: the attention backend stores ``k @ R`` and attends with ``q @ R``, for one fixed orthogonal
``R [head_dim, head_dim]``, a randomized Hadamard matrix (:func:`kv_rotation`); scores are unchanged in exact
arithmetic (``(qR)(kR)^T = qk^T``). Real models' keys carry a few outlier channels that set each row's absmax,
so a per-row scale leaves the other channels few levels; the rotation spreads every channel over all of them.
On SmolLM2-135M (6 windows of 256) it cut the int8 cache's KL against the float cache from 7.1e-4 to 2.6e-4;
rotating the values as well gave no further gain (2.3e-4) for two more matmuls a layer, so values are stored
as they are. The kernels need no change: they store and read whatever rows they are given.

Stored scales: a checkpoint with a ``kv_cache_scheme`` brings its own calibrated FP8 scales (one per layer or per KV
head, :mod:`quantkit.runtime.kv_stored_scales`); its cache stores ``e4m3(x / scale)`` under them as vLLM does, with no
per-row scales and no rotation (the scales were calibrated on the keys as they are). Its reads are this module's:
each layer's scales are handed out broadcast over every slot, so the read paths and kernels see the per-slot
layout they know.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.rotation.hadamard import random_rotation

SCALE_DTYPE = torch.float16
# storage dtype and the largest magnitude it holds, per 8-bit kv_cache_dtype
QUANT_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
}
_MIN_SCALE = 2.0**-14  # smallest normal float16: keeps the scale's float16 rounding relative
_MAX_SCALE = 60000.0  # below float16's max once multiplied by _SCALE_ROUND_UP
_SCALE_ROUND_UP = 1.0 + 2.0**-10  # >= one float16 ulp (relative) above: the rounded scale is never below absmax/qmax
_HALF = torch.tensor(0.5)
KV_ROTATION_SEED = 0  # any fixed seed: every write and read of a cache only needs the same rotation


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype != "auto" and kv_cache_dtype not in QUANT_FORMATS:
        raise QuantkitError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid; use one of {['auto', *QUANT_FORMATS]}")


def is_quantized(kv_cache_dtype: str) -> bool:
    check_kv_cache_dtype(kv_cache_dtype)
    return kv_cache_dtype != "auto"


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache's values: ``dtype`` (the compute dtype) for "auto", else the 8-bit format."""
    return QUANT_FORMATS[kv_cache_dtype][0] if is_quantized(kv_cache_dtype) else dtype


def qmax_of(dtype: torch.dtype) -> float:
    for fmt, qmax in QUANT_FORMATS.values():
        if fmt == dtype:
            return qmax
    raise ValueError(f"{dtype} is not an 8-bit KV cache format (int8 or float8_e4m3fn)")


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    row_scales: bool = True,
) -> int:
    """Bytes of one KV block over all layers, K and V, per-row scales included (``row_scales=False``: a cache under
    stored scales, which keeps none per row)."""
    elem = torch.empty((), dtype=storage_dtype(kv_cache_dtype, dtype)).element_size()
    per_head = head_dim * elem + (SCALE_DTYPE.itemsize if is_quantized(kv_cache_dtype) and row_scales else 0)
    return 2 * num_layers * block_size * num_kv_heads * per_head


# ------------------------------------------------------------------------------------ quantize / dequantize


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (values ``[..., D]`` in ``dtype`` (int8 / float8_e4m3fn), float16 scales ``[...]``)."""
    qmax = qmax_of(dtype)
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)
    scale = absmax.div_(qmax).clamp_(_MIN_SCALE, _MAX_SCALE).mul_(_SCALE_ROUND_UP).to(SCALE_DTYPE)
    q = xf / scale.float().unsqueeze(-1)
    if dtype == torch.int8:  # round half away from zero (as in-kernel): the int8 cast truncates q + sign(q) / 2
        q += torch.copysign(_HALF, q)
    return q.clamp_(-qmax, qmax).to(dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values [..., D]`` (8-bit) times ``scales [...]`` -> ``dtype`` (multiplied in float32)."""
    out = values.float()
    # in place: a second context-sized float32 tensor (fresh pages to fault in) cost 1.6x the whole decode step
    return out.mul_(scales.float().unsqueeze(-1)).to(dtype)


@functools.cache
def kv_rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """The float32 orthogonal ``[head_dim, head_dim]`` rotation of 8-bit key rows (see the module docstring)."""
    return random_rotation(head_dim, KV_ROTATION_SEED).to(device=device, dtype=torch.float32)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x [..., D] @ rotation`` computed in float32, returned in ``x``'s dtype."""
    if x.dtype == torch.float32:
        return x @ rotation
    return (x.float() @ rotation).to(x.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an 8-bit tensor (``index_copy_`` has no float8 kernel on CPU)."""
    return t.view(torch.uint8)


def write_rows(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``x [T, Hkv, D]`` and store it (and its scales) at flat slots of ``cache [N, bs, Hkv, D]`` /
    ``scales [N, bs, Hkv]``. Every slot must be valid (no -1 padding: the runner never produces it)."""
    _store(*quantize_rows(x, cache.dtype), cache, scales, slot_mapping)


def write_key_value_rows(
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`write_rows` of ``k`` and ``v`` at the same slots, quantized together: one set of small ops a
    layer instead of two (at decode, where each op touches a few rows, that halved the write's time)."""
    q, s = quantize_rows(torch.stack((k, v)), caches[0].dtype)
    for i in range(2):
        _store(q[i], s[i], caches[i], scales[i], slot_mapping)


def _store(
    values: torch.Tensor, row_scales: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
) -> None:
    heads, dim = cache.shape[2], cache.shape[3]
    _bytes(cache).view(-1, heads, dim).index_copy_(0, slots, _bytes(values))
    scales.view(-1, heads).index_copy_(0, slots, row_scales)


def gather_pages(
    cache: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``cache[pages]`` (``[P, bs, Hkv, D]``) in ``dtype``: dequantized when ``scales`` is given, else cast."""
    values = cache.index_select(0, pages)
    if scales is None:
        return values.to(dtype)
    return dequantize(values, scales.index_select(0, pages), dtype)


# ------------------------------------------------------------------------------------ the cache


@dataclass(slots=True, frozen=True)
class LayerKV:
    """One layer's paged cache, what its attention reads and writes: key and value pages ``[num_blocks, block_size,
    Hkv, D]`` (views into :class:`KVCache`) and, for 8-bit storage, their float16 scales ``[num_blocks, block_size,
    Hkv]`` and the rotation keys are stored in (all ``None`` when the cache holds the compute dtype)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    rotation: torch.Tensor | None = None  # [D, D] float32 (:func:`kv_rotation`)
    # the checkpoint's calibrated per-head scales (K, V: float32 [Hkv]); writes quantize under them, and
    # k_scale / v_scale are then these broadcast over every slot
    stored_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


class KVCache:
    """Every layer's K/V pages: ``values [2, L, num_blocks, block_size, Hkv, D]`` (K then V) in the storage
    dtype and, for 8-bit storage, ``scales [2, L, num_blocks, block_size, Hkv]`` float16 (else ``None``); under a
    checkpoint's ``stored_scales [2, L, Hkv]`` (float32, an FP8 cache) no per-row scales."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        device: torch.device | str = "cpu",
        stored_scales: torch.Tensor | None = None,
    ) -> None:
        expected = ("fp8", (2, num_layers, num_kv_heads))
        if stored_scales is not None and (kv_cache_dtype, tuple(stored_scales.shape)) != expected:
            raise ValueError(
                f"stored scales are for an fp8 cache, [2, {num_layers}, {num_kv_heads}]; got {kv_cache_dtype} "
                f"{list(stored_scales.shape)}"
            )
        self.kv_cache_dtype = kv_cache_dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        row_scales = stored_scales is None
        self.bytes_per_block = bytes_per_block(
            num_layers, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype, row_scales
        )
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.values = torch.zeros(shape, dtype=storage_dtype(kv_cache_dtype, dtype), device=device)
        self.scales: torch.Tensor | None = None
        self.stored_scales = stored_scales.float().to(device) if stored_scales is not None else None
        if is_quantized(kv_cache_dtype) and row_scales:
            self.scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)

    @property
    def quantized(self) -> bool:
        return self.scales is not None or self.stored_scales is not None

    @property
    def nbytes(self) -> int:
        scales = sum(t.nbytes for t in (self.scales, self.stored_scales) if t is not None)
        return self.values.nbytes + scales

    def layer(self, i: int) -> LayerKV:
        """Layer ``i``'s pages (and, for 8-bit storage, its scales and the key rotation)."""
        if self.stored_scales is not None:
            k_scale, v_scale = self.stored_scales[0, i], self.stored_scales[1, i]
            slots = (self.num_blocks, self.block_size, k_scale.shape[0])
            return LayerKV(
                self.values[0, i],
                self.values[1, i],
                k_scale.expand(slots),  # one scale per head for every slot: no copy
                v_scale.expand(slots),
                stored_scales=(k_scale, v_scale),
            )
        if self.scales is None:
            return LayerKV(self.values[0, i], self.values[1, i])
        rotation = kv_rotation(self.values.shape[-1], self.values.device)
        return LayerKV(self.values[0, i], self.values[1, i], self.scales[0, i], self.scales[1, i], rotation)
