"""Quantization grids: scale / zero-point search and (fake) quantization. Pure tensor functions, no I/O.

Convention (see :mod:`quantkit.scheme`): signed integers ``q`` in ``[qmin, qmax]``, ``w = (q - zero) * scale``.
Scales are rounded to the checkpoint's storage dtype (``scale_dtype``) *before* they are used to quantize,
so a checkpoint that stores bf16/fp16 scales reproduces the solver's dequantized weights bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.scheme import QuantizedWeight, QuantScheme

# mse_clip: candidate shrink factors of the range, 1.0 (plain) first, down to 0.5.
MSE_SHRINKS: tuple[float, ...] = tuple(1.0 - i / 100 for i in range(51))

QParams = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(slots=True, frozen=True)
class _Grid:
    """A scheme resolved once into the numbers the range-to-params function needs."""

    qmin: int
    qmax: int
    scale_dtype: torch.dtype

    @property
    def levels(self) -> int:
        return self.qmax - self.qmin  # 2**bits - 1 steps


def _round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Replace degenerate scales, round to the storage dtype, and keep the result finite and positive."""
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero-range rows: any scale is exact
    info = torch.finfo(dtype)
    return scale.to(dtype).float().clamp(min=info.tiny, max=info.max)


def _sym_params(lo: torch.Tensor, hi: torch.Tensor, grid: _Grid) -> QParams:
    absmax = torch.maximum(lo.abs(), hi.abs())
    return _round_scale(absmax / (grid.levels / 2), grid.scale_dtype), None


def _asym_params(lo: torch.Tensor, hi: torch.Tensor, grid: _Grid) -> QParams:
    scale = _round_scale((hi - lo) / grid.levels, grid.scale_dtype)
    zero = torch.round(grid.qmin - lo / scale).clamp(grid.qmin, grid.qmax)
    return scale, zero.to(torch.int8)


def _params_fn(scheme: QuantScheme) -> Callable[[torch.Tensor, torch.Tensor, _Grid], QParams]:
    return _sym_params if scheme.symmetric else _asym_params


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme) -> torch.Tensor:
    """int8 ``q = clamp(round(w / scale) + zero, qmin, qmax)``; ``scale``/``zero`` broadcast ([N, 1] for [N, L])."""
    q = torch.round(w.float() / scale)
    if zero is not None:
        q = q + zero.float()
    return q.clamp(scheme.qmin, scheme.qmax).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """float32 ``(q - zero) * scale`` (same arithmetic as :meth:`QuantizedWeight.dequantize`)."""
    qf = q.float()
    if zero is not None:
        qf = qf - zero.float()
    return qf * scale


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme) -> torch.Tensor:
    """Quantize then dequantize: the float32 values the checkpoint will reproduce."""
    return dequantize(quantize(w, scale, zero, scheme), scale, zero)


def compute_qparams(
    w: torch.Tensor,
    scheme: QuantScheme,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
    col_weight: torch.Tensor | None = None,
) -> QParams:
    """Scale (float32 [N, 1]) and zero (int8 [N, 1] or None) for one group of columns ``w`` [N, L].

    With ``scheme.mse_clip`` the range is shrunk per row by the factor in :data:`MSE_SHRINKS` that minimises
    ``sum_j col_weight_j * (w - fake_quantize(w))**2`` (``col_weight`` defaults to ones; GPTQ passes diag(H)).
    The unshrunk range is tried first and only a strictly lower error replaces it.
    """
    w = w.float()
    grid = _Grid(scheme.qmin, scheme.qmax, scale_dtype)
    params = _params_fn(scheme)
    lo = w.amin(dim=1, keepdim=True).clamp(max=0.0)
    hi = w.amax(dim=1, keepdim=True).clamp(min=0.0)
    if not scheme.mse_clip:
        return params(lo, hi, grid)
    weight = torch.ones(w.shape[1], device=w.device) if col_weight is None else col_weight.float().to(w.device)
    best_scale, best_zero, best_err = None, None, None
    for shrink in MSE_SHRINKS:
        scale, zero = params(lo * shrink, hi * shrink, grid)
        err = ((w - fake_quantize(w, scale, zero, scheme)).square() * weight).sum(dim=1, keepdim=True)
        if best_err is None:
            best_scale, best_zero, best_err = scale, zero, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def group_slices(in_features: int, scheme: QuantScheme) -> list[slice]:
    """Column slices of the groups in column order (the last may be shorter)."""
    step = scheme.group_len(in_features)
    return [slice(start, min(start + step, in_features)) for start in range(0, in_features, step)]


def quantize_rtn(
    W: torch.Tensor,
    scheme: QuantScheme,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
    col_weight: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Round-to-nearest over contiguous column groups (``g_idx`` is None)."""
    W = W.detach().float()
    n, k = W.shape
    slices = group_slices(k, scheme)
    qweight = torch.empty(n, k, dtype=torch.int8, device=W.device)
    scales = torch.empty(n, len(slices), device=W.device)
    zeros = None if scheme.symmetric else torch.empty(n, len(slices), dtype=torch.int8, device=W.device)
    for g, cols in enumerate(slices):
        cw = None if col_weight is None else col_weight[cols]
        scale, zero = compute_qparams(W[:, cols], scheme, scale_dtype=scale_dtype, col_weight=cw)
        qweight[:, cols] = quantize(W[:, cols], scale, zero, scheme)
        scales[:, g : g + 1] = scale
        if zeros is not None:
            zeros[:, g : g + 1] = zero
    return QuantizedWeight(qweight=qweight, scale=scales, zero=zeros, g_idx=None, scheme=scheme)
