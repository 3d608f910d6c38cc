"""Scatter new K/V rows into the paged cache.

``k``/``v [T, Hkv, D]`` go to ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]`` at flat slot
``slot_mapping[t] = block_id * block_size + offset`` (int64); slot ``-1`` (padding) is skipped. Values are cast
to the cache dtype.

8-bit caches (int8 / float8_e4m3fn, with ``k_scale``/``v_scale`` float16 ``[num_blocks, block_size, Hkv]``):
each (token, head) row is quantized in-kernel exactly as :func:`quantkit.runtime.kv_cache.quantize_rows` does
(absmax over the head dim, float16 scale rounded up, divide, round half away from zero / e4m3 cast, store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_QUANT_DTYPES = {torch.int8: (1, 127.0), torch.float8_e4m3fn: (2, 448.0)}  # QUANT code, qmax


@triton.jit
def _kv_cache_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcn,
    stride_kcs,
    stride_kch,
    stride_vcn,
    stride_vcs,
    stride_vch,
    ks_ptr,  # float16 scales [num_blocks, block_size, Hkv] (8-bit caches only)
    vs_ptr,
    stride_ksn,
    stride_kss,
    stride_ksh,
    stride_vsn,
    stride_vss,
    stride_vsh,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANT: tl.constexpr = 0,  # 0: cast, 1: int8, 2: fp8 e4m3
    QMAX: tl.constexpr = 1.0,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        page = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kc = k_cache_ptr + page * stride_kcn + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        vc = v_cache_ptr + page * stride_vcn + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        if QUANT == 0:
            tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
        else:
            h_mask = offs_h < NUM_HEADS
            kq, ks = _quantize_rows(tl.where(mask, k.to(tl.float32), 0.0), QUANT, QMAX)
            vq, vs = _quantize_rows(tl.where(mask, v.to(tl.float32), 0.0), QUANT, QMAX)
            tl.store(kc, kq.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, vq.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(ks_ptr + page * stride_ksn + off * stride_kss + offs_h * stride_ksh, ks, mask=h_mask)
            tl.store(vs_ptr + page * stride_vsn + off * stride_vss + offs_h * stride_vsh, vs, mask=h_mask)


@triton.jit
def _quantize_rows(x, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """``x`` fp32 [H, D] -> (quantized values as fp32 integers / e4m3-representable, float16 scales [H])."""
    absmax = tl.max(tl.abs(x), axis=1)
    # clamp to [2^-14, 60000] and round up by 2^-10 before the float16 cast (as kv_cache.quantize_rows)
    scale = (tl.minimum(tl.maximum(absmax / QMAX, 6.103515625e-05), 60000.0) * 1.0009765625).to(tl.float16)
    q = x / scale.to(tl.float32)[:, None]
    if QUANT == 1:
        q = tl.where(q >= 0, tl.floor(q + 0.5), tl.ceil(q - 0.5))
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    return q, scale


def _check_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (an 8-bit cache) or neither")
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"cache heads/head dim {tuple(k_cache.shape[2:])} do not match k {tuple(k.shape[1:])}")
    if k_scale is not None and v_scale is not None:
        _check_quantized_cache(k_cache, v_cache, k_scale, v_scale, k.device)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if k_scale is not None and name.endswith("cache"):
            continue  # checked above
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16/bfloat16/float32, got {t.dtype}")
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k is on {k.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"the head dimension of {name} must be contiguous (stride 1)")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, k is on {k.device}")


def _check_quantized_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    device: torch.device,
    scale_dtypes: tuple[torch.dtype, ...] = (torch.float16,),
) -> None:
    """8-bit caches of one format with scales ``[num_blocks, block_size, Hkv]`` (shared by the kernels): float16 as
    the write kernel computes them; the read kernel also takes a checkpoint's float32 scales, broadcast over slots."""
    if k_cache.dtype not in _QUANT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"with scales, k_cache/v_cache must share an 8-bit dtype (int8 or float8_e4m3fn), got {k_cache.dtype} "
            f"and {v_cache.dtype}"
        )
    for name, t, cache in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if t.dtype not in scale_dtypes or tuple(t.shape) != tuple(cache.shape[:3]):
            dtypes = "/".join(str(d).removeprefix("torch.") for d in scale_dtypes)
            raise ValueError(
                f"{name} must be {dtypes} {tuple(cache.shape[:3])} (one scale per slot and kv head), got {t.dtype} "
                f"{tuple(t.shape)}"
            )
        if t.device != device or cache.device != device:
            raise ValueError(f"{name} and its cache must be on {device}")
        if cache.stride(-1) != 1:
            raise ValueError("the head dimension of the caches must be contiguous (stride 1)")


def kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` into the caches in place (slots are not range-checked: no device sync); with
    ``k_scale``/``v_scale`` the caches are 8-bit and each (token, head) row is quantized with its own scale."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    tokens, heads, d = k.shape
    if tokens == 0:
        return
    quant, qmax = _QUANT_DTYPES[k_cache.dtype] if k_scale is not None else (0, 1.0)
    ks = k_scale if k_scale is not None else k_cache  # unused without QUANT
    vs = v_scale if v_scale is not None else v_cache
    s_ks = ks.stride()[:3] if k_scale is not None else (0, 0, 0)
    s_vs = vs.stride()[:3] if v_scale is not None else (0, 0, 0)
    _kv_cache_write_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        ks,
        vs,
        *s_ks,
        *s_vs,
        NUM_HEADS=heads,
        H_PAD=triton.next_power_of_2(heads),
        HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d),
        QUANT=quant,
        QMAX=qmax,
        num_warps=1 if heads * d <= 1024 else 4,
    )


def kv_cache_write_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference (in place): ``index_copy_`` of the rows whose slot is not -1 (caches must be contiguous)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    heads, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, d).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, heads, d).index_copy_(0, slots, v[keep].to(v_cache.dtype))
