"""Decode attention (one query token per sequence) over a paged KV cache.

Layout: ``q [B, Hq, D]``; ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]``; ``block_tables`` int32
``[B, max_blocks]`` (page ids of each sequence, in order); ``context_lens`` int32 ``[B]``. Token ``t`` of
sequence ``b`` lives at ``cache[block_tables[b, t // block_size], t % block_size]``. Grouped-query attention:
query head ``h`` reads kv head ``h // (Hq // Hkv)``. Output ``[B, Hq, D]`` in ``q.dtype``; a sequence with
context length 0 gets zeros.

The kernel runs one program per (sequence, kv head, partition): all query heads of a kv group share each K/V
load; long contexts are split into partitions (flash-decoding) whose partial softmax states are merged by a
second small kernel. With a sliding ``window`` a sequence attends to its last ``window`` keys only: the programs
start there (a partition wholly before it contributes nothing to the merge).

8-bit caches (int8 / float8_e4m3fn) come with float16 ``k_scale``/``v_scale [num_blocks, block_size, Hkv]``
(one scale per token slot and kv head): the kernel loads the 8-bit rows and their scales and dequantizes in
registers (``value * scale`` in fp32), so a K/V load moves 1 byte per element plus 2 bytes per row.
A cache under a checkpoint's stored scales passes each layer's float32 per-head scales broadcast over the slots
(stride 0): the same loads, served from cache.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,  # [B, Hq, D] when NUM_PARTS == 1, else fp32 partial acc [B, Hq, P, D]
    m_ptr,  # fp32 [B, Hq, P] running max (log2 domain), only when NUM_PARTS > 1
    l_ptr,  # fp32 [B, Hq, P] running denominator
    scale_log2,
    block_size,
    window,  # keys seen: the last ``window`` of the context (the block-table capacity when there is no window)
    stride_qb,
    stride_qh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_op,
    ks_ptr,  # float16 [num_blocks, block_size, Hkv] scales of an 8-bit cache (only when QUANT)
    vs_ptr,
    stride_ksn,
    stride_kss,
    stride_ksh,
    stride_vsn,
    stride_vss,
    stride_vsh,
    QPK: tl.constexpr,  # query heads per kv head
    QPK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per iteration
    PARTITION: tl.constexpr,  # tokens per partition (multiple of BLOCK_N)
    NUM_PARTS: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    start = part * PARTITION
    offs_h = kvh * QPK + tl.arange(0, QPK_PAD)
    h_mask = tl.arange(0, QPK_PAD) < QPK
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full((QPK_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QPK_PAD,), dtype=tl.float32)
    acc = tl.zeros((QPK_PAD, D_PAD), dtype=tl.float32)

    end = tl.minimum(ctx, start + PARTITION)
    for t0 in range(tl.maximum(start, ctx - window), end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_mask = offs_t < end
        page = tl.load(bt_ptr + b * stride_btb + offs_t // block_size, mask=t_mask, other=0).to(tl.int64)
        slot_in_page = offs_t % block_size
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + page[:, None] * stride_kn + slot_in_page[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        if QUANT:
            k_sc = tl.load(
                ks_ptr + page * stride_ksn + slot_in_page * stride_kss + kvh * stride_ksh, mask=t_mask, other=0.0
            )
            k = k * k_sc.to(tl.float32)[:, None]
        # scores [QPK_PAD, BLOCK_N]; broadcast-reduce works for any QPK (tl.dot needs >= 16 rows)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + page[:, None] * stride_vn + slot_in_page[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        if QUANT:
            v_sc = tl.load(
                vs_ptr + page * stride_vsn + slot_in_page * stride_vss + kvh * stride_vsh, mask=t_mask, other=0.0
            )
            v = v * v_sc.to(tl.float32)[:, None]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_PARTS == 1:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        o_ptrs = out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + part * stride_op + offs_d[None, :]
        tl.store(o_ptrs, acc, mask=out_mask)
        ml_off = (b * tl.num_programs(1) * QPK + offs_h) * NUM_PARTS + part
        tl.store(m_ptr + ml_off, m_i, mask=h_mask)
        tl.store(l_ptr + ml_off, l_i, mask=h_mask)


@triton.jit
def _merge_partitions_kernel(
    acc_ptr,  # fp32 [B, Hq, P, D]
    m_ptr,  # fp32 [B, Hq, P]
    l_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    P_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, P_PAD)
    p_mask = offs_p < NUM_PARTS
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    row = (b * num_heads + h) * NUM_PARTS
    m = tl.load(m_ptr + row + offs_p, mask=p_mask, other=float("-inf"))
    l_part = tl.load(l_ptr + row + offs_p, mask=p_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_safe), 0.0)
    acc = tl.load(
        acc_ptr + (row + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_part * w, axis=0)
    res = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[int, int, int, int]:
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (an 8-bit cache) or neither")
    if q.ndim != 3 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be a float [B, Hq, D] tensor, got {q.dtype} {tuple(q.shape)}")
    bsz, hq, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    if k_scale is not None and v_scale is not None:
        from quantkit.runtime.kernels.kv_cache_write import _check_quantized_cache

        _check_quantized_cache(k_cache, v_cache, k_scale, v_scale, q.device, (torch.float16, torch.float32))
    elif k_cache.dtype not in _FLOAT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache/v_cache must share a float dtype, got {k_cache.dtype} and {v_cache.dtype}")
    _, _, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and of the cache ({dk}) differ")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if block_tables.dtype != torch.int32 or block_tables.ndim != 2 or block_tables.shape[0] != bsz:
        raise ValueError(
            f"block_tables must be int32 [{bsz}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (bsz,):
        raise ValueError(f"context_lens must be int32 [{bsz}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("context_lens", context_lens),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous (stride 1)")
    return bsz, hq, hkv, d


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    partition_size: int = 512,
    block_n: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Triton decode attention; returns ``[B, Hq, D]`` in ``q.dtype``.

    With ``k_scale``/``v_scale`` the caches are 8-bit (int8 / float8_e4m3fn) and are dequantized in-kernel; with
    ``window`` each sequence attends to its last ``window`` keys.

    ``partition_size`` (a power of two) bounds the tokens one program handles; the number of partitions is
    taken from the block table width (no device sync), programs past a sequence's end exit at once.
    Context lengths are not range-checked: they must be ``<= max_blocks * block_size``.
    """
    bsz, hq, hkv, d = _check_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if bsz == 0 or hq == 0:
        return out
    block_size = int(k_cache.shape[1])
    max_tokens = int(block_tables.shape[1]) * block_size
    bn = block_n or min(64, max(16, triton.next_power_of_2(block_size)))
    if partition_size % bn or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two and a multiple of block_n={bn}, got {partition_size}")
    num_parts = max(1, math.ceil(max_tokens / partition_size))
    qpk = hq // hkv
    d_pad = triton.next_power_of_2(d)
    if num_parts > 1:
        acc = torch.empty(bsz, hq, num_parts, d, dtype=torch.float32, device=q.device)
        m = torch.empty(bsz, hq, num_parts, dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        dest, s_ob, s_oh, s_op = acc, acc.stride(0), acc.stride(1), acc.stride(2)
    else:
        m = l_sum = out  # unused
        dest, s_ob, s_oh, s_op = out, out.stride(0), out.stride(1), 0
    _paged_attention_kernel[(bsz, hkv, num_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        dest,
        m,
        l_sum,
        float(scale) * math.log2(math.e),
        block_size,
        min(window or max_tokens, max_tokens),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        s_ob,
        s_oh,
        s_op,
        k_scale if k_scale is not None else k_cache,  # unused without QUANT
        v_scale if v_scale is not None else v_cache,
        *(k_scale.stride() if k_scale is not None else (0, 0, 0)),
        *(v_scale.stride() if v_scale is not None else (0, 0, 0)),
        QPK=qpk,
        QPK_PAD=triton.next_power_of_2(qpk),
        HEAD_DIM=d,
        D_PAD=d_pad,
        BLOCK_N=bn,
        PARTITION=partition_size,
        NUM_PARTS=num_parts,
        QUANT=k_scale is not None,
        num_warps=4,
    )
    if num_parts > 1:
        _merge_partitions_kernel[(bsz, hq)](
            acc,
            m,
            l_sum,
            out,
            out.stride(0),
            out.stride(1),
            hq,
            HEAD_DIM=d,
            D_PAD=d_pad,
            NUM_PARTS=num_parts,
            P_PAD=triton.next_power_of_2(num_parts),
            num_warps=4,
        )
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Per-sequence reference: gather the pages, explicit fp32 softmax attention over the last ``window`` keys (all
    without one); output in ``q.dtype``."""
    bsz, hq, d = q.shape
    block_size, hkv = int(k_cache.shape[1]), int(k_cache.shape[2])
    out = torch.zeros(bsz, hq, d, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        ctx = int(context_lens[b])
        if ctx == 0:
            continue
        pages = block_tables[b, : math.ceil(ctx / block_size)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(hq // hkv, dim=1)  # [T, Hq, D]
        v = v_cache[pages].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
        first = max(0, ctx - window) if window else 0
        scores = torch.einsum("hd,thd->ht", q[b].float(), k[first:]) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v[first:])
    return out.to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Batched torch implementation (same math as the reference) for backends without Triton.

    Gathers every sequence's pages up to the block-table width, masks positions past each context length and
    runs one fp32 softmax; cost grows with ``max_blocks * block_size``, so trim the block table to the longest
    context before calling.
    """
    bsz, hq, d = q.shape
    block_size, hkv = int(k_cache.shape[1]), int(k_cache.shape[2])
    qpk = hq // hkv
    pages = block_tables.long().clamp(0, k_cache.shape[0] - 1)  # padding entries may hold anything
    length = pages.shape[1] * block_size
    k = k_cache[pages].reshape(bsz, length, hkv, d).float()  # [B, T, Hkv, D]
    v = v_cache[pages].reshape(bsz, length, hkv, d).float()
    qg = q.float().reshape(bsz, hkv, qpk, d)
    scores = torch.einsum("bgqd,btgd->bgqt", qg, k) * scale
    valid = torch.arange(length, device=q.device)[None, :] < context_lens.to(q.device)[:, None]  # [B, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)  # empty contexts -> zeros
    out = torch.einsum("bgqt,btgd->bgqd", probs, v)
    return out.reshape(bsz, hq, d).to(q.dtype)
