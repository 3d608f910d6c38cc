"""Scatter new K/V rows into the paged cache.

``k``/``v [T, Hkv, D]`` go to ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]`` at flat slot
``slot_mapping[t] = block_id * block_size + offset`` (int64); slot ``-1`` (padding) is skipped. Values are cast
to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
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
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"cache heads/head dim {tuple(k_cache.shape[2:])} do not match k {tuple(k.shape[1:])}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
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


def kv_cache_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k``/``v`` into the caches in place (slots are not range-checked: no device sync)."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    tokens, heads, d = k.shape
    if tokens == 0:
        return
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
        NUM_HEADS=heads,
        H_PAD=triton.next_power_of_2(heads),
        HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d),
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
