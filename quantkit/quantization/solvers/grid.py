"""Quantization grids: scale / zero-point search and (fake) quantization. Pure tensor functions, no I/O.

Convention (see :mod:`quantkit.scheme`): signed integers ``q`` in ``[qmin, qmax]``, ``w = (q - zero) * scale``.
Scales are rounded to the checkpoint's storage dtype (``scale_dtype``) *before* they are used to quantize,
so a checkpoint that stores bf16/fp16 scales reproduces the solver's dequantized weights bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.format.scheme import QuantizedWeight, QuantScheme

# mse_clip: shrink factors of the range searched coarse to fine: every 0.05 from 1.0 (plain) down to 0.5, then
# every 0.01 within 0.04 of each row's best. 19 evaluations instead of 51 for every 0.01, and nearly the
# exhaustive search's error: a row's best factor lies near the coarse best (the comparison is in docs/benchmarks.md).
MSE_COARSE_SHRINKS: tuple[float, ...] = tuple(1.0 - i / 20 for i in range(11))
MSE_FINE_OFFSETS: tuple[float, ...] = (-0.04, -0.03, -0.02, -0.01, 0.01, 0.02, 0.03, 0.04)
MSE_MIN_SHRINK = 0.5

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

    With ``scheme.mse_clip`` the range is shrunk per row by the factor that minimises
    ``sum_j col_weight_j * (w - fake_quantize(w))**2`` (``col_weight`` [L] or [N, L], defaults to ones; GPTQ
    passes diag(H)), searched coarse to fine (see :data:`MSE_COARSE_SHRINKS`). The unshrunk range is tried
    first and only a strictly lower error replaces it.
    """
    w = w.float()
    grid = _Grid(scheme.qmin, scheme.qmax, scale_dtype)
    params = _params_fn(scheme)
    lo = w.amin(dim=1, keepdim=True).clamp(max=0.0)
    hi = w.amax(dim=1, keepdim=True).clamp(min=0.0)
    if not scheme.mse_clip:
        return params(lo, hi, grid)
    weight = torch.ones(w.shape[1], device=w.device) if col_weight is None else col_weight.float().to(w.device)
    work = torch.empty_like(w)
    best_scale, best_zero = params(lo, hi, grid)
    best_err = _weighted_error(w, best_scale, best_zero, scheme, weight, work)
    best_shrink = torch.ones_like(lo)

    def try_shrink(shrink: torch.Tensor) -> None:
        nonlocal best_scale, best_zero, best_err, best_shrink
        scale, zero = params(lo * shrink, hi * shrink, grid)
        err = _weighted_error(w, scale, zero, scheme, weight, work)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_shrink = torch.where(better, shrink, best_shrink)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)

    for shrink in MSE_COARSE_SHRINKS[1:]:
        try_shrink(torch.full_like(lo, shrink))
    coarse_best = best_shrink
    for offset in MSE_FINE_OFFSETS:
        try_shrink((coarse_best + offset).clamp(MSE_MIN_SHRINK, 1.0))
    return best_scale, best_zero


def _weighted_error(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    scheme: QuantScheme,
    weight: torch.Tensor,
    work: torch.Tensor,
) -> torch.Tensor:
    """Per-row ``sum_j weight_j * (w - fake_quantize(w))**2`` [R, 1], in place in ``work`` (same arithmetic as
    :func:`fake_quantize`, without its int8 round trip)."""
    torch.div(w, scale, out=work).round_()
    if zero is None:
        work.clamp_(scheme.qmin, scheme.qmax)
    else:
        zf = zero.float()
        work.add_(zf).clamp_(scheme.qmin, scheme.qmax).sub_(zf)
    work.mul_(scale).sub_(w).square_().mul_(weight)
    return work.sum(dim=1, keepdim=True)


def all_group_qparams(
    W: torch.Tensor,
    scheme: QuantScheme,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
    col_weight: torch.Tensor | None = None,
) -> QParams:
    """Scale [N, G] and zero ([N, G] or None) of every contiguous column group of ``W`` [N, K] in one search.

    Same values as :func:`compute_qparams` group by group, computed on a [N * G, L] view: the (shorter) last
    group is padded with zero columns of zero weight, which leave its range and its error unchanged.
    """
    W = W.float()
    n, k = W.shape
    size, groups = scheme.group_len(k), scheme.num_groups(k)
    weight = torch.ones(k, device=W.device) if col_weight is None else col_weight.float().to(W.device)
    pad = size * groups - k
    if pad:
        W = torch.nn.functional.pad(W, (0, pad))
        weight = torch.nn.functional.pad(weight, (0, pad))
    rows = W.reshape(n * groups, size)
    row_weight = weight.reshape(1, groups, size).expand(n, groups, size).reshape(n * groups, size)
    scale, zero = compute_qparams(rows, scheme, scale_dtype=scale_dtype, col_weight=row_weight)
    return scale.reshape(n, groups), None if zero is None else zero.reshape(n, groups)


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
    scales, zeros = all_group_qparams(W, scheme, scale_dtype=scale_dtype, col_weight=col_weight)
    qweight = torch.empty(n, k, dtype=torch.int8, device=W.device)
    for g, cols in enumerate(group_slices(k, scheme)):
        zero = None if zeros is None else zeros[:, g : g + 1]
        qweight[:, cols] = quantize(W[:, cols], scales[:, g : g + 1], zero, scheme)
    return QuantizedWeight(qweight=qweight, scale=scales, zero=zeros, g_idx=None, scheme=scheme)
