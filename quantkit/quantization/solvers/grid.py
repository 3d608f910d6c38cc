"""Quantization grids: scale / zero-point search and (fake) quantization. Pure tensor functions, no I/O.

Convention (see :mod:`quantkit.format.scheme`): signed integers ``q`` in ``[qmin, qmax]``, ``w = (q - zero) * scale``;
float codes (FP8 E4M3, FP4 E2M1) ``q`` in ``[-max, max]``, ``w = q * scale``.
Scales are rounded to the checkpoint's storage format (``scale_dtype``; FP8 under NVFP4's global scale; a power of
two for the MX formats) *before* they are used to quantize, so the checkpoint reproduces the solver's dequantized
weights bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantkit.format.float_codes import E8M0_BIAS, FP4_MAX, FP8_MAX, e8m0_value, mx_scale_exponent, round_fp4
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
    """A scheme resolved once into the numbers the range-to-params and rounding functions need."""

    qmin: float
    qmax: float
    scale_dtype: torch.dtype
    element: str = "int"  # "int", "fp8" or "fp4": how a scaled value is rounded to a code
    scale_format: str = "native"
    bits: int = 8
    global_scale: torch.Tensor | None = None  # NVFP4: float32 [1] the FP8 group scales are stored under

    @property
    def levels(self) -> float:
        return self.qmax - self.qmin  # 2**bits - 1 steps for integers; 2 * max for floats


def code_grid(scheme: QuantScheme, scale_dtype: torch.dtype, global_scale: torch.Tensor | None = None) -> _Grid:
    if not scheme.is_float:
        return _Grid(scheme.qmin, scheme.qmax, scale_dtype)
    element = "fp8" if scheme.bits == 8 else "fp4"
    top = scheme.element_max
    return _Grid(-top, top, scale_dtype, element, scheme.scale_format, scheme.bits, global_scale)


def round_codes_(t: torch.Tensor, grid: _Grid) -> torch.Tensor:
    """Round scaled values (``w / scale``, float32, symmetric grids) to codes, in place: integers clamped to
    ``[qmin, qmax]``, or the nearest FP8 / FP4 value after clamping to the format's range."""
    if grid.element == "int":
        return t.round_().clamp_(grid.qmin, grid.qmax)
    t.clamp_(grid.qmin, grid.qmax)
    if grid.element == "fp8":
        return t.copy_(t.to(torch.float8_e4m3fn))
    return t.copy_(round_fp4(t))


def global_scale_of(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor | None:
    """NVFP4's float32 [1] global scale of a weight (or a row-stacked set of weights that one fused projection
    serves): the largest group scale lands on FP8's largest value (``448 * 6 / absmax``, compressed-tensors'
    ``generate_gparam``); None for every other scheme."""
    if scheme.scale_format != "fp8":
        return None
    absmax = w.detach().abs().amax().float().clamp(min=torch.finfo(torch.float32).tiny)
    scale = FP8_MAX * FP4_MAX / absmax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def _round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Replace degenerate scales, round to the storage dtype, and keep the result finite and positive."""
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero-range rows: any scale is exact
    info = torch.finfo(dtype)
    return scale.to(dtype).float().clamp(min=info.tiny, max=info.max)


def _float_scale(absmax: torch.Tensor, grid: _Grid) -> torch.Tensor:
    """The effective scale of float codes for groups with these absolute maxima, rounded as it is stored."""
    if grid.scale_format == "e8m0":
        exponent = mx_scale_exponent(absmax, grid.bits).clamp(0, 2 * E8M0_BIAS)
        return e8m0_value(exponent)
    if grid.scale_format == "fp8":
        if grid.global_scale is None:
            raise ValueError("NVFP4 group scales need the weight's global scale (global_scale_of)")
        g = grid.global_scale.to(absmax.device)
        stored = (absmax / grid.qmax * g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
        # zero-range groups: any scale is exact; FP8's smallest normal keeps the division by it finite
        stored = torch.where(stored > 0, stored, torch.full_like(stored, 2.0**-6))
        return stored / g
    return _round_scale(absmax / grid.qmax, grid.scale_dtype)


def _sym_params(lo: torch.Tensor, hi: torch.Tensor, grid: _Grid) -> QParams:
    absmax = torch.maximum(lo.abs(), hi.abs())
    if grid.element != "int":
        return _float_scale(absmax, grid), None
    return _round_scale(absmax / (grid.levels / 2), grid.scale_dtype), None


def _asym_params(lo: torch.Tensor, hi: torch.Tensor, grid: _Grid) -> QParams:
    scale = _round_scale((hi - lo) / grid.levels, grid.scale_dtype)
    zero = torch.round(grid.qmin - lo / scale).clamp(grid.qmin, grid.qmax)
    return scale, zero.to(torch.int8)


def _params_fn(scheme: QuantScheme) -> Callable[[torch.Tensor, torch.Tensor, _Grid], QParams]:
    return _sym_params if scheme.symmetric else _asym_params


def quantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    scheme: QuantScheme,
) -> torch.Tensor:
    """Codes of ``w`` (:attr:`QuantScheme.code_dtype`): integers ``clamp(round(w / scale) + zero, qmin, qmax)``
    or float codes ``round_fp(clamp(w / scale))``; ``scale``/``zero`` broadcast ([N, 1] for [N, L])."""
    if scheme.is_float:
        q = round_codes_(w.float() / scale, code_grid(scheme, torch.float32))
        return q.to(scheme.code_dtype)
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
    global_scale: torch.Tensor | None = None,
) -> QParams:
    """Scale (float32 [N, 1]) and zero (int8 [N, 1] or None) for one group of columns ``w`` [N, L].

    With ``scheme.mse_clip`` the range is shrunk per row by the factor that minimises
    ``sum_j col_weight_j * (w - fake_quantize(w))**2`` (``col_weight`` [L] or [N, L], defaults to ones; GPTQ
    passes diag(H)), searched coarse to fine (see :data:`MSE_COARSE_SHRINKS`). The unshrunk range is tried
    first and only a strictly lower error replaces it. ``global_scale``: NVFP4's (:func:`global_scale_of` of the
    whole weight), which its group scales are stored under.
    """
    w = w.float()
    grid = code_grid(scheme, scale_dtype, global_scale)
    params = _params_fn(scheme)
    lo = w.amin(dim=1, keepdim=True).clamp(max=0.0)
    hi = w.amax(dim=1, keepdim=True).clamp(min=0.0)
    if not scheme.mse_clip:
        return params(lo, hi, grid)
    weight = torch.ones(w.shape[1], device=w.device) if col_weight is None else col_weight.float().to(w.device)
    work = torch.empty_like(w)
    best_scale, best_zero = params(lo, hi, grid)
    best_err = _weighted_error(w, best_scale, best_zero, grid, weight, work)
    best_shrink = torch.ones_like(lo)

    def try_shrink(shrink: torch.Tensor) -> None:
        nonlocal best_scale, best_zero, best_err, best_shrink
        scale, zero = params(lo * shrink, hi * shrink, grid)
        err = _weighted_error(w, scale, zero, grid, weight, work)
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
    grid: _Grid,
    weight: torch.Tensor,
    work: torch.Tensor,
) -> torch.Tensor:
    """Per-row ``sum_j weight_j * (w - fake_quantize(w))**2`` [R, 1], in place in ``work`` (same arithmetic as
    :func:`fake_quantize`, without its round trip through the code dtype)."""
    torch.div(w, scale, out=work)
    if zero is None:
        round_codes_(work, grid)
    else:
        zf = zero.float()
        work.round_().add_(zf).clamp_(grid.qmin, grid.qmax).sub_(zf)
    work.mul_(scale).sub_(w).square_().mul_(weight)
    return work.sum(dim=1, keepdim=True)


def all_group_qparams(
    W: torch.Tensor,
    scheme: QuantScheme,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
    col_weight: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> QParams:
    """Scale [N, G] and zero ([N, G] or None) of every contiguous column group of ``W`` [N, K] in one search
    ([1, 1] for one scale per tensor; block scales repeated over the rows of their tile).

    Same values as :func:`compute_qparams` group by group, computed on a [N * G, L] view: the (shorter) last
    group is padded with zero columns of zero weight, which leave its range and its error unchanged.
    """
    W = W.float()
    n, k = W.shape
    weight = torch.ones(k, device=W.device) if col_weight is None else col_weight.float().to(W.device)
    if scheme.per_tensor:  # one row holding every weight
        rows, row_weight = W.reshape(1, -1), weight.repeat(n).reshape(1, -1)
        return compute_qparams(rows, scheme, scale_dtype=scale_dtype, col_weight=row_weight, global_scale=global_scale)
    if scheme.block:
        return _block_qparams(W, weight, scheme, scale_dtype)
    size, groups = scheme.group_len(k), scheme.num_groups(k)
    pad = size * groups - k
    if pad:
        W = torch.nn.functional.pad(W, (0, pad))
        weight = torch.nn.functional.pad(weight, (0, pad))
    rows = W.reshape(n * groups, size)
    row_weight = weight.reshape(1, groups, size).expand(n, groups, size).reshape(n * groups, size)
    scale, zero = compute_qparams(
        rows, scheme, scale_dtype=scale_dtype, col_weight=row_weight, global_scale=global_scale
    )
    return scale.reshape(n, groups), None if zero is None else zero.reshape(n, groups)


def _block_qparams(W: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> QParams:
    """One scale per ``block x block`` tile (the edge tiles padded with zeros of zero weight), returned as [N, G]
    with each tile's scale repeated over its rows."""
    n, k = W.shape
    b = scheme.block
    rb, cb = -(-n // b), -(-k // b)
    padded = torch.nn.functional.pad(W, (0, cb * b - k, 0, rb * b - n))
    tiles = padded.reshape(rb, b, cb, b).permute(0, 2, 1, 3).reshape(rb * cb, b * b)
    tile_weight = torch.nn.functional.pad(weight, (0, cb * b - k)).reshape(1, cb, 1, b).expand(rb, cb, b, b)
    scale, _ = compute_qparams(tiles, scheme, scale_dtype=scale_dtype, col_weight=tile_weight.reshape(rb * cb, -1))
    return scale.reshape(rb, cb).repeat_interleave(b, dim=0)[:n].contiguous(), None


def group_slices(in_features: int, scheme: QuantScheme) -> list[slice]:
    """Column slices of the groups in column order (the last may be shorter)."""
    step = scheme.group_len(in_features)
    return [slice(start, min(start + step, in_features)) for start in range(0, in_features, step)]


def row_stack(weights: Sequence[torch.Tensor], scheme: QuantScheme) -> tuple[torch.Tensor, list[slice]]:
    """Linears that share an input as one row-stacked float32 matrix, and each one's rows in it. Under a block
    scheme each linear starts on a tile boundary (zero rows pad the one before: they widen no tile's range), so
    every tile's scale belongs to one linear, as the checkpoint stores it."""
    align = scheme.block or 1
    parts, slices, start = [], [], 0
    for w in weights:
        n = w.shape[0]
        pad = -n % align
        parts.append(torch.nn.functional.pad(w.float(), (0, 0, 0, pad)) if pad else w.float())
        slices.append(slice(start, start + n))
        start += n + pad
    return torch.cat(parts), slices


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
    global_scale = global_scale_of(W, scheme)
    scales, zeros = all_group_qparams(
        W, scheme, scale_dtype=scale_dtype, col_weight=col_weight, global_scale=global_scale
    )
    qweight = torch.empty(n, k, dtype=scheme.code_dtype, device=W.device)
    for g, cols in enumerate(group_slices(k, scheme)):
        zero = None if zeros is None else zeros[:, g : g + 1]
        qweight[:, cols] = quantize(W[:, cols], scales[:, g : g + 1], zero, scheme)
    return QuantizedWeight(
        qweight=qweight, scale=scales, zero=zeros, g_idx=None, scheme=scheme, global_scale=global_scale
    )
