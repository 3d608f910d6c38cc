"""W4A16 / W8A16 matmul reading compressed-tensors ``pack-quantized`` weights directly.

``y[M, N] = x[M, K] @ dequant(W)^T (+ bias)`` where ``W`` is stored as (see :mod:`quantkit.format.pack`):

- ``weight_packed`` int32 ``[N, ceil(K*b/32)]``: little-endian bit stream along K of ``q + 2**(b-1)``;
- ``weight_scale`` ``[N, ceil(K/G)]`` (fp16/bf16/fp32);
- ``weight_zero_point`` (asymmetric only) int32 ``[ceil(N*b/32), ceil(K/G)]``: signed zeros packed along N;
- ``g_idx`` (act-order only) int32 ``[K]``: group of each input column, else ``k // G``.

Dequant: ``w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]``. Only ``bits`` 4 and 8 are supported (a value
never straddles two words). Accumulation is fp32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantkit.format.pack import packed_words, unpack_int32

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KERNEL_BITS = (4, 8)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    G,
    k_blocks_per_split,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_os,
    stride_om,
    stride_on,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_UNIFORM: tl.constexpr,  # every K-block lies inside one group: scale applied after the dot
    DOT_FP32: tl.constexpr,  # run the dot in fp32 (fp32 inputs, or bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    VPW: tl.constexpr = 32 // BITS  # values per int32 word
    BLOCK_KW: tl.constexpr = BLOCK_K // VPW  # words per K-block
    MASK: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)

    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    shifts = tl.arange(0, VPW) * BITS
    num_words = (K + VPW - 1) // VPW
    if HAS_ZERO:
        z_row = (offs_n // VPW) * stride_zn
        z_shift = (offs_n % VPW) * BITS

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb_start = pid_k * k_blocks_per_split
    kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    for kb in range(kb_start, kb_end):
        k0 = kb * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # one load per word, then expand each word into its VPW values: [BLOCK_KW, VPW, BLOCK_N] -> [BLOCK_K, BLOCK_N]
        offs_kw = k0 // VPW + tl.arange(0, BLOCK_KW)
        words = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_kw[:, None] * stride_wk,
            mask=n_mask[None, :] & (offs_kw < num_words)[:, None],
            other=0,
        )
        q = (words[:, None, :] >> shifts[None, :, None]) & MASK
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)) - HALF
        if DOT_FP32:
            x = x.to(tl.float32)
        if GROUP_UNIFORM:
            g = k0 // G
            s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                zw = tl.load(z_ptr + z_row + g * stride_zg, mask=n_mask, other=0)
                q = q - (((zw >> z_shift) & MASK) - HALF)[None, :]
            # small integers are exact in fp16/bf16; int -> fp32 -> dtype (the interpreter mis-casts int -> bf16)
            w = q.to(tl.float32).to(x.dtype)
            part = tl.dot(x, w, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            acc += part * s[None, :]
        else:
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0) if HAS_GIDX else offs_k // G
            gk_mask = n_mask[None, :] & k_mask[:, None]
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g[:, None] * stride_sg, mask=gk_mask, other=0.0)
            if HAS_ZERO:
                zw = tl.load(z_ptr + z_row[None, :] + g[:, None] * stride_zg, mask=gk_mask, other=0)
                q = q - (((zw >> z_shift[None, :]) & MASK) - HALF)
            w = (q.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION, out_dtype=tl.float32)

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class QuantMatmulConfig:
    """Tile configuration; ``split_k > 1`` writes fp32 partials that the launcher sums."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache(maxsize=16)  # the launcher runs per layer per step: no device query each time
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _group_uniform(block_k: int, group: int, k: int, has_gidx: bool) -> bool:
    return not has_gidx and (group >= k or group % block_k == 0)


def default_config(
    m: int, n: int, k: int, bits: int, group: int, has_gidx: bool, device: torch.device
) -> QuantMatmulConfig:
    """Heuristic tiles: decode (M <= 16) splits N and K finely; prefill uses large M/N tiles.

    Untuned starting points (no autotuning, so the first call compiles exactly one variant per shape class).
    """
    vpw = 32 // bits
    if m <= 16:
        block_m, block_n, block_k, warps = 16, 64, 128, 4
    elif m <= 64:
        block_m, block_n, block_k, warps = 64, 128, 64, 4
    else:
        block_m, block_n, block_k, warps = 128, 128, 64, 8
    # keep the scale-after-dot fast path: shrink BLOCK_K to a divisor of the group when possible
    if not has_gidx and group < k:
        bk = block_k
        while bk > max(16, vpw) and group % bk:
            bk //= 2
        block_k = bk if group % bk == 0 else block_k  # no fitting divisor: keep the gather path's larger tile
    split_k = 1
    if m <= 16:
        tiles = math.ceil(n / block_n) * math.ceil(m / block_m)
        k_blocks = math.ceil(k / block_k)
        want = max(1, (2 * _num_sms(device)) // tiles)
        split_k = max(1, min(want, k_blocks, 16))
    return QuantMatmulConfig(block_m, block_n, block_k, split_k, warps, 3)


def _check_inputs(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate the packed layout against ``x``; returns (K, N, effective group length)."""
    if bits not in _KERNEL_BITS:
        raise ValueError(f"quant_matmul supports bits in {_KERNEL_BITS}, got {bits}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float16/bfloat16/float32, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., K)")
    k = int(x.shape[-1])
    if k == 0:
        raise ValueError("x has K = 0 input features")
    if weight_packed.dtype != torch.int32 or weight_packed.ndim != 2:
        raise ValueError(
            f"weight_packed must be a 2-D int32 tensor, got {weight_packed.dtype} {tuple(weight_packed.shape)}"
        )
    n = int(weight_packed.shape[0])
    if weight_packed.shape[1] != packed_words(k, bits):
        raise ValueError(
            f"weight_packed has {weight_packed.shape[1]} words per row; "
            f"K={k} at {bits} bits needs {packed_words(k, bits)}"
        )
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    group = k if group_size == -1 else group_size
    n_groups = math.ceil(k / group)
    if weight_scale.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight_scale must be float16/bfloat16/float32, got {weight_scale.dtype}")
    if tuple(weight_scale.shape) != (n, n_groups):
        raise ValueError(f"weight_scale must have shape {(n, n_groups)}, got {tuple(weight_scale.shape)}")
    if weight_zero_point is not None:
        want = (packed_words(n, bits), n_groups)
        if weight_zero_point.dtype != torch.int32 or tuple(weight_zero_point.shape) != want:
            raise ValueError(
                f"weight_zero_point must be int32 {want} (packed along N), got "
                f"{weight_zero_point.dtype} {tuple(weight_zero_point.shape)}"
            )
    if g_idx is not None and (g_idx.dtype != torch.int32 or tuple(g_idx.shape) != (k,)):
        raise ValueError(f"g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    if bias is not None and (bias.dtype not in _FLOAT_DTYPES or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias must be a float tensor of shape ({n},), got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (
        ("weight_packed", weight_packed),
        ("weight_scale", weight_scale),
        ("weight_zero_point", weight_zero_point),
        ("g_idx", g_idx),
        ("bias", bias),
    ):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")
    return k, n, group


def quant_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    config: QuantMatmulConfig | None = None,
) -> torch.Tensor:
    """``x[..., K] @ dequant(W)^T (+ bias)`` with the Triton kernel; output ``[..., N]`` in ``x.dtype``.

    Tensors are read in place through their strides (no repacking). ``g_idx`` values are not range-checked
    (that would synchronize the device); they must lie in ``[0, ceil(K/G))``.
    """
    k, n, group = _check_inputs(x, weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = int(x2.shape[0])
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    cfg = config or default_config(m, n, k, bits, group, g_idx is not None, x.device)
    vpw = 32 // bits
    if cfg.block_k % vpw or cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16 and a multiple of {vpw}, got {cfg.block_k}")
    k_blocks = math.ceil(k / cfg.block_k)
    per_split = math.ceil(k_blocks / max(1, cfg.split_k))
    split_k = math.ceil(k_blocks / per_split)
    if split_k > 1:
        dest = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        stride_os = dest.stride(0)
        stride_om, stride_on = dest.stride(1), dest.stride(2)
    else:
        dest = out
        stride_os, stride_om, stride_on = 0, out.stride(0), out.stride(1)
    interpreting = x.device.type != "cuda"
    dot_fp32 = x.dtype == torch.float32 or (interpreting and x.dtype == torch.bfloat16)
    zp = weight_zero_point if weight_zero_point is not None else weight_packed  # dummy pointer when symmetric
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    _quant_matmul_kernel[grid](
        x2,
        weight_packed,
        weight_scale,
        zp,
        g_idx if g_idx is not None else weight_packed,
        bias if (bias is not None and split_k == 1) else weight_scale,
        dest,
        m,
        n,
        k,
        group,
        per_split,
        x2.stride(0),
        x2.stride(1),
        weight_packed.stride(0),
        weight_packed.stride(1),
        weight_scale.stride(0),
        weight_scale.stride(1),
        zp.stride(0),
        zp.stride(1),
        stride_os,
        stride_om,
        stride_on,
        BITS=bits,
        HAS_ZERO=weight_zero_point is not None,
        HAS_GIDX=g_idx is not None,
        HAS_BIAS=bias is not None and split_k == 1,
        GROUP_UNIFORM=_group_uniform(cfg.block_k, group, k, g_idx is not None),
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split_k > 1:
        acc = dest.sum(0)
        if bias is not None:
            acc += bias.float()
        out.copy_(acc)
    return out.reshape(*lead, n)


def dequantize_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """Plain-torch dequantization of the packed layout to fp32 ``[N, K]`` (unpacks on CPU)."""
    n, k = int(weight_packed.shape[0]), in_features
    device = weight_packed.device
    q = unpack_int32(weight_packed.cpu(), bits, k).to(device=device, dtype=torch.float32)
    group = k if group_size == -1 else group_size
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=device) // group
    if weight_zero_point is not None:
        z = unpack_int32(weight_zero_point.cpu(), bits, n, dim=0).to(device=device, dtype=torch.float32)
        q = q - z[:, groups]
    return q * weight_scale.float()[:, groups]


def quant_matmul_reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: unpack, dequantize and matmul in fp32; output in ``x.dtype``."""
    w = dequantize_packed(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, int(x.shape[-1]))
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
