"""Fused residual add + RMSNorm.

``new_residual = x + residual`` (rounded to the residual's storage dtype, as the eager model does) and
``normed = weight * (new_residual / sqrt(mean(new_residual**2) + eps))``. Statistics are fp32; as in Hugging
Face ``LlamaRMSNorm`` the normalized row is rounded to ``x.dtype`` before the weight multiply. Output in
``x.dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    H,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(normed, new_residual)``; ``new_residual`` is ``x`` itself when ``residual`` is None.

    ``x``/``residual`` are ``[..., H]`` with a contiguous last dim; new tensors are returned (inputs untouched).
    """
    if x.dtype not in _FLOAT_DTYPES or x.ndim < 1:
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor [..., H], got {x.dtype} {tuple(x.shape)}")
    h = int(x.shape[-1])
    if weight.dtype not in _FLOAT_DTYPES or tuple(weight.shape) != (h,):
        raise ValueError(f"weight must be a float tensor of shape ({h},), got {weight.dtype} {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype not in _FLOAT_DTYPES):
        raise ValueError(f"residual must be a float tensor of shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")
    x2 = x.reshape(-1, h)
    r2 = residual.reshape(-1, h) if residual is not None else x2
    if x2.stride(1) != 1 or r2.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("the hidden dimension of x, residual and weight must be contiguous")
    rows = int(x2.shape[0])
    out = torch.empty(rows, h, dtype=x.dtype, device=x.device)
    new_res = torch.empty(rows, h, dtype=residual.dtype, device=x.device) if residual is not None else out
    if rows and h:
        block_h = triton.next_power_of_2(h)
        _rmsnorm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_res,
            h,
            float(eps),
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h,
            num_warps=min(16, max(1, block_h // 256)),
        )
    if residual is None:
        return out.reshape(x.shape), x
    return out.reshape(x.shape), new_res.reshape(x.shape)


def rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference with the same rounding points as the kernel (and as HF ``LlamaRMSNorm``)."""
    out_dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(residual.dtype)
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(out_dtype).float() * weight.float()).to(out_dtype), x
