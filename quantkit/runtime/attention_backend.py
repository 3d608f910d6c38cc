"""Attention over the paged KV cache: a torch backend (any device) and a Triton backend (CUDA).

Both write the step's new K/V rows into the cache first (``slot_mapping``), then:

* prefill: per sequence, causal attention of its ``n`` new queries over its whole context ``[0, ctx)``. With no
  cached prefix the fresh K/V are used directly; after a prefix-cache hit or an earlier chunk, the context is
  gathered from the sequence's pages (the new rows included, as they were just written).
* decode: one query per sequence over its pages, batched.

The torch backend runs ``scaled_dot_product_attention`` (decode packs the query heads of a kv group as rows,
so grouped-query attention needs no K/V repeat). The Triton backend uses the ``kv_cache_write`` and
``paged_attention`` kernels and the torch prefill.

Per layer (:class:`~quantkit.runtime.layers.Attention`): a sliding ``window`` lets the query at position i see the
keys i - window < j <= i only (transformers' rule; Mistral, Phi-3, Gemma 3's sliding layers), on every path: the
cache keeps every block, the keys before the window are masked (the Triton decode kernel starts at the window);
``softcap`` (Gemma 2) caps the scaled scores at ``softcap * tanh(scores / softcap)`` before the mask, computed as
transformers' eager attention does (scores, cap, mask, fp32 softmax cast to the query dtype, times V), in torch.

8-bit KV cache (:mod:`quantkit.runtime.kv_cache`): a layer's :class:`LayerKV` then carries ``k_scale``/``v_scale``
(float16 ``[num_blocks, block_size, Hkv]``) and the caches hold int8 / float8_e4m3fn values; every write quantizes
(per token and kv head) and every read dequantizes; keys are stored in a rotated basis (``LayerKV.rotation``), so
queries are rotated the same way. Under a checkpoint's stored scales (``LayerKV.stored_scales``) writes quantize
under them instead and keys are not rotated. Prefill then always reads K/V back from the pages, the fresh rows
included, so a token sees the same (quantized) keys and values whether its context was computed in one prefill, in
chunks, from the prefix cache or by decoding. Without scales every path is exactly the unquantized one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.runtime.kernels.backend import triton_available
from quantkit.runtime.kv_cache import LayerKV, gather_pages, rotate, write_key_value_rows
from quantkit.runtime.kv_stored_scales import write_under_stored_scales


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flattened tokens (built once per step by the model runner)."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    block_tables: torch.Tensor  # int32 [B, max_blocks] (padded with 0), trimmed to the longest context
    context_lens: torch.Tensor  # int32 [B]: tokens in the cache once this step's rows are written
    query_lens: list[int]  # new tokens per sequence (all 1 when decoding)
    context_lens_list: list[int]  # context_lens as Python ints (prefill loops over sequences)
    decode_mask: torch.Tensor | None = None  # bool [B, 1, 1, max_blocks * block_size]: key t < context_len
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # decode_mask within each window, lazily
    state_slots: list[int] | None = None  # each sequence's state slot (hybrid models' linear-attention layers)


class AttentionBackend(ABC):
    name = "base"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> None:
        if kv.stored_scales is not None:  # FP8 under the checkpoint's calibrated scales
            write_under_stored_scales(k, v, (kv.k, kv.v), kv.stored_scales, meta.slot_mapping)
            return
        if kv.k_scale is not None and kv.v_scale is not None:  # 8-bit cache: quantize each (token, head) row
            write_key_value_rows(k, v, (kv.k, kv.v), (kv.k_scale, kv.v_scale), meta.slot_mapping)
            return
        heads, dim = kv.k.shape[2], kv.k.shape[3]
        kv.k.view(-1, heads, dim).index_copy_(0, meta.slot_mapping, k.to(kv.k.dtype))
        kv.v.view(-1, heads, dim).index_copy_(0, meta.slot_mapping, v.to(kv.v.dtype))

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention (one query token per sequence) over the paged cache (dequantized with scales)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, Hq, D]``; ``window``/``softcap``/``sinks`` ``[Hq]``: the
        module docstring."""
        if kv.rotation is not None:  # keys are stored rotated (kv_cache's docstring), so attend with rotated queries
            q, k = rotate(q, kv.rotation), rotate(k, kv.rotation)
        self.write_kv(k, v, kv, meta)
        if meta.is_prefill:
            return prefill_attention(q, k, v, kv, meta, scale, window, softcap, sinks)
        return self.decode(q, kv, meta, scale, window, softcap, sinks)


def _gather(
    cache: torch.Tensor,
    table: torch.Tensor,
    length: int,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The first ``length`` tokens of one sequence's pages: ``[length, Hkv, D]`` (with ``scales``: dequantized
    to ``dtype``; without, in the cache dtype)."""
    pages = table[: -(-length // cache.shape[1])]
    if scales is None:
        return cache.index_select(0, pages).flatten(0, 1)[:length]
    return gather_pages(cache, scales, pages, dtype or torch.float32).flatten(0, 1)[:length]


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its context (within ``window`` when given). With an
    8-bit cache (already written) K/V are always read back from the pages and dequantized, the new rows included."""
    out = torch.empty_like(q)
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list, strict=True)):
        qi = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        if kv.k_scale is not None and kv.v_scale is not None:  # 8-bit cache: what the pages hold
            table = meta.block_tables[i]
            ki, vi = _gather(kv.k, table, ctx, kv.k_scale, q.dtype), _gather(kv.v, table, ctx, kv.v_scale, q.dtype)
        elif ctx == n:  # nothing cached before this chunk: attend to the fresh rows
            ki, vi = k[start : start + n], v[start : start + n]
        else:  # a cached prefix or an earlier chunk: read the whole context back from the pages
            ki, vi = _gather(kv.k, meta.block_tables[i], ctx), _gather(kv.v, meta.block_tables[i], ctx)
            ki, vi = ki.to(q.dtype), vi.to(q.dtype)
        mask = prefill_mask(n, ctx, window, q.device)
        head_sinks = None if sinks is None else sinks.view(-1, 1, 1)  # [Hq, 1, 1] against scores [Hq, n, ctx]
        oi = attend(qi, ki.transpose(0, 1), vi.transpose(0, 1), mask, scale, softcap, sinks=head_sinks)
        out[start : start + n] = oi.transpose(0, 1)
        start += n
    return out


def prefill_mask(n: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """bool ``[n, ctx]``: the last ``n`` of ``ctx`` positions as queries, each seeing the keys up to itself (the
    bottom-right causal mask) and, with a ``window``, only the last ``window`` of them; None where that is plain
    causal attention over ``n == ctx`` positions."""
    if ctx == n and (window is None or window >= n):
        return None
    q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
    keys = torch.arange(ctx, device=device)[None, :]
    mask = keys <= q_pos
    return mask if window is None else mask & (keys > q_pos - window)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    enable_gqa: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale, mask) v`` over ``[..., H, L, D]`` tensors (with ``enable_gqa`` k/v may have fewer
    heads); no mask means causal. Without ``softcap`` and ``sinks`` it is ``scaled_dot_product_attention``; with
    either, transformers' eager attention: the scores capped, and (gpt_oss) a sink logit per head, broadcast against
    the scores' ``[..., 1]``, joining each row's softmax (max subtracted, softmax in the scores' dtype) and dropped
    after it, so the row's weights sum to less than one."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
        )
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    combined = torch.cat((scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def decode(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch_decode(q, kv, meta, scale, window, softcap, sinks)


def decode_key_mask(meta: AttentionMetadata, length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool ``[B, 1, 1, length]``: the keys each sequence's query sees (those before its context length and, with
    a ``window``, within its last ``window`` keys); built once per step and window, shared by the layers."""
    mask = meta.decode_mask
    if mask is None:
        mask = torch.arange(length, device=device)[None, :] < meta.context_lens[:, None]
        mask = mask[:, None, None, :]
    if window is None:
        return mask
    if window not in meta.window_masks:
        keys = torch.arange(mask.shape[-1], device=device)[None, :]
        inside = keys >= (meta.context_lens[:, None] - window)
        meta.window_masks[window] = mask & inside[:, None, None, :]
    return meta.window_masks[window]


def torch_decode(
    q: torch.Tensor,
    kv: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention with torch ops (any device); with scales the gathered pages are dequantized."""
    bsz, hq, dim = q.shape
    hkv = kv.k.shape[2]
    pages = meta.block_tables.flatten()  # index_select is much faster than advanced indexing on CPU
    if kv.k_scale is not None and kv.v_scale is not None:
        k = gather_pages(kv.k, kv.k_scale, pages, q.dtype).view(bsz, -1, hkv, dim).transpose(1, 2)
        v = gather_pages(kv.v, kv.v_scale, pages, q.dtype).view(bsz, -1, hkv, dim).transpose(1, 2)
    else:
        k = kv.k.index_select(0, pages).view(bsz, -1, hkv, dim).transpose(1, 2)  # [B, Hkv, L, D]
        v = kv.v.index_select(0, pages).view(bsz, -1, hkv, dim).transpose(1, 2)
    mask = decode_key_mask(meta, k.shape[2], window, q.device)
    qg = q.reshape(bsz, hkv, hq // hkv, dim)  # the query heads of a kv group act as rows
    group_sinks = None if sinks is None else sinks.view(hkv, hq // hkv, 1)  # head h = kv group * G + g, as qg's rows
    out = attend(qg, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap, enable_gqa=False, sinks=group_sinks)
    return out.reshape(bsz, hq, dim)


class TritonAttentionBackend(AttentionBackend):
    # full attention only: a hybrid's gated DeltaNet layers never reach a backend and run in torch (runtime/deltanet.py)
    name = "triton"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> None:
        from quantkit.runtime.kernels.kv_cache_write import kv_cache_write

        # the write kernel computes each row's own scale; rows under stored scales are written by torch
        if kv.stored_scales is not None or (kv.quantized and not _triton_handles(kv.k)):
            super().write_kv(k, v, kv, meta)
        else:
            kv_cache_write(k, v, kv.k, kv.v, meta.slot_mapping, k_scale=kv.k_scale, v_scale=kv.v_scale)

    def decode(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from quantkit.runtime.kernels.paged_attention import paged_attention

        # the kernel has no soft-capping (Gemma 2's attention) and no attention sinks (gpt_oss): those layers decode
        # in torch (the same math as backend='torch'; adding a sink term to the kernel's online softmax is the fix)
        if softcap is not None or sinks is not None or (kv.quantized and not _triton_handles(kv.k)):
            return torch_decode(q, kv, meta, scale, window, softcap, sinks)
        return paged_attention(
            q.contiguous(),
            kv.k,
            kv.v,
            meta.block_tables,
            meta.context_lens,
            scale,
            k_scale=kv.k_scale,
            v_scale=kv.v_scale,
            window=window,
        )


def _triton_handles(cache: torch.Tensor) -> bool:
    """Triton converts float8_e4m3fn only on GPUs of compute capability >= 8.9 (and in the CPU interpreter);
    elsewhere an fp8 cache falls back to the torch write and decode (same math)."""
    if cache.dtype != torch.float8_e4m3fn or cache.device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(cache.device) >= (8, 9)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: Triton on CUDA when it imports and its kernels pass their check, else torch (with a warning naming
    a failed kernel); ``triton`` fails clearly where it cannot run."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda" and triton_available():
            from quantkit.runtime.kernels.selfcheck import kernels_usable  # each kernel run once per device

            name = "triton" if kernels_usable(device) else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if not triton_available():
            from quantkit.extras import install_command

            raise QuantkitError(
                f"backend='triton' needs triton (the 'gpu' extra: {install_command('gpu')}) and a CUDA device (or "
                "TRITON_INTERPRET=1 set before triton is imported, for testing); use backend='torch' or 'auto'"
            )
        return TritonAttentionBackend()
    raise QuantkitError(f"backend={name!r} is invalid; use 'auto', 'torch' or 'triton'")
