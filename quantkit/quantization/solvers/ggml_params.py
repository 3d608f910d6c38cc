"""A GGML type's stored parameters for a weight, chosen before any rounding of the weights themselves.

- 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): the float search's best and the reference quantizer's own choice
  (``max / -8``, ``amax / 127``, ``(max - min) / nmax``, ``max / -127``) are rounded to fp16 as stored, the block
  re-rounded on each, the better kept, then refit twice by least squares on its own levels (a Lloyd step) where that
  lowers the error. On each block the error is therefore never above the reference quantizer's under the same
  weights.
- K-quants: the float sub-block scales (and mins) come from the search; the fp16 super-block scale ``d`` (and
  ``dmin``) is searched like llama.cpp's ``make_qp_quants``, in the scale domain, weighting each sub-block by how fast
  its error grows with its scale (sum w * level^2; sum w for the min); then each sub-block's integer codes move to the
  neighbour (+-1 in sc and m) with the lowest weighted round-to-nearest error on the decoded values, and to the codes
  of a least-squares refit on their own levels where that is lower still.
"""

from __future__ import annotations

import torch

from quantkit.format.ggml.grids import GGMLGrid, GGMLParams
from quantkit.quantization.solvers.ggml_grid import (
    F16_MAX,
    affine_fit,
    division_scale,
    grid_error,
    refit_affine,
    refit_symmetric,
    symmetric_fit,
)

SYM_STEPS = tuple(round(0.1 * i, 1) for i in range(-9, 10))  # make_qx_quants' +-0.9 around nmax
CODEBOOK_STEPS = tuple(float(i) for i in range(-7, 8))  # IQ4_NL: quantize_row_iq4_nl_impl's ntry = 7
AFFINE_STEPS = tuple(round(-1.0 + 0.2 * i, 1) for i in range(11))  # make_qkx2_quants' range, in steps of 0.2
COARSE_STEPS = (-1.0, -0.5, 0.0, 0.5)
# (anchor, steps): the full range [min, max], then ranges starting at half the min and at zero
AFFINE_SEARCHES = ((1.0, AFFINE_STEPS), (0.5, COARSE_STEPS), (0.0, COARSE_STEPS))
SUPER_STEPS = (-2.0, -1.5, -1.0, -0.7, -0.4, -0.2, 0.0, 0.2, 0.4, 0.7, 1.0)
REFINE_RADIUS = 1
REFITS = 2  # least-squares refits of the stored parameters on their own levels
CHUNK_ELEMENTS = 1 << 20  # weights per row chunk of the search (4 MB float32 temporaries)


def _f16(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=0.0).clamp(-F16_MAX, F16_MAX).half()


def _keep(best: list[torch.Tensor] | None, err: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    if best is None:
        return [err, *values]
    better = err < best[0]
    return [
        torch.where(better.reshape(*better.shape, *[1] * (a.ndim - better.ndim)), a, b)
        for a, b in zip((err, *values), best, strict=True)
    ]


def _direct(x: torch.Tensor, w: torch.Tensor, grid: GGMLGrid) -> GGMLParams:
    """32-blocks: fp16 d (and m) per block: the search's best and the reference quantizer's choice, each rounded to
    fp16 as stored and the block re-rounded on it; the one with the lower weighted error is kept."""
    if grid.affine:
        fit = affine_fit(x, w, grid, AFFINE_SEARCHES, min_below_zero=False)
        lo, hi = x.amin(-1), x.amax(-1)  # quantize_row_q4_1_ref: d = (max - min) / nmax, m = min
        best = None
        for scale, off in ((fit.scale, fit.offset), ((hi - lo) / grid.hi, -lo)):
            d, m = _f16(scale), _f16(-off)
            best = _keep(best, grid_error(x, w, d.float(), -m.float(), grid), d, m)
        for _ in range(REFITS):  # refit d and m on the levels the stored pair rounds to (a Lloyd step)
            assert best is not None
            scale, off = refit_affine(x, w, grid, best[1].float(), -best[2].float())
            d, m = _f16(scale), _f16(-off)
            best = _keep(best, grid_error(x, w, d.float(), -m.float(), grid), d, m)
        assert best is not None
        return GGMLParams(best[1], best[2])
    zero = x.new_zeros(x.shape[:-1])
    fit = symmetric_fit(x, w, grid, SYM_STEPS if grid.codebook is None else CODEBOOK_STEPS)
    mx = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)
    reference = mx / (grid.lo if grid.codebook is None else grid.codebook[0])  # max / -8, amax / 127, max / -127
    best = None
    for cand in (fit.scale, reference):
        d = _f16(cand)
        best = _keep(best, grid_error(x, w, d.float(), zero, grid), d)
    for _ in range(REFITS):
        assert best is not None
        d = _f16(refit_symmetric(x, w, grid, best[1].float()))
        best = _keep(best, grid_error(x, w, d.float(), zero, grid), d)
    assert best is not None
    return GGMLParams(best[1])


def _super_codes(a: torch.Tensor, c: torch.Tensor, codes: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``d`` [N, B] and integer codes [N, B, P] with ``d * code ~ a`` (float sub-block values [N, B, P]),
    minimizing ``sum c (a - d * code)^2`` over stretched ranges and their least-squares refits."""
    lo, hi = codes
    if lo < 0:  # signed codes: the largest magnitude lands on the longer (negative) side, as llama.cpp places it
        ref = a.gather(-1, a.abs().argmax(-1, keepdim=True)).squeeze(-1)
        top = float(-lo)
        sign = -1.0
    else:
        ref = a.amax(-1)
        top = float(hi)
        sign = 1.0
    best = None
    for step in SUPER_STEPS:
        d = sign * ref / (top + step)
        q = (a / division_scale(d).unsqueeze(-1)).round().clamp(lo, hi)
        num, den = (c * a * q).sum(-1), (c * q * q).sum(-1)
        for cand in (d, torch.where(den > 0, num / den.clamp_min(1e-30), d)):
            d16 = _f16(cand)
            df = d16.float().unsqueeze(-1)
            q = (a / division_scale(df)).round().clamp(lo, hi)
            best = _keep(best, (c * (a - df * q).square()).sum(-1), d16, q)
    assert best is not None
    return best[1], best[2].to(torch.int16)


def _refine(x: torch.Tensor, w: torch.Tensor, grid: GGMLGrid, p: GGMLParams) -> GGMLParams:
    """Each sub-block's codes (sc, and m) moved to the neighbour with the lowest weighted error as decoded, then
    to the codes of a least-squares refit on the levels they round to, where that is lower still."""
    assert p.sc is not None and grid.scale_codes is not None
    n = x.shape[0]
    d = p.d.float().repeat_interleave(grid.per_block, dim=1)
    sc0 = p.sc.reshape(n, -1)
    shifts = range(-REFINE_RADIUS, REFINE_RADIUS + 1)
    dmin = None if p.dmin is None else p.dmin.float().repeat_interleave(grid.per_block, dim=1)
    mn0 = sc0 if p.mn is None else p.mn.reshape(n, -1)  # symmetric grids: a stand-in, never stored

    def offset(mn: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(d) if dmin is None else dmin * mn.float()

    best = None
    for ds in shifts:
        sc = (sc0 + ds).clamp(*grid.scale_codes)
        for dm in shifts if dmin is not None else (0,):
            mn = mn0 if dmin is None else (mn0 + dm).clamp(*grid.min_codes)  # type: ignore[misc]
            best = _keep(best, grid_error(x, w, d * sc.float(), offset(mn), grid), sc, mn)
    for _ in range(REFITS):
        assert best is not None
        s, o = d * best[1].float(), offset(best[2])
        if dmin is None:
            a, b = refit_symmetric(x, w, grid, s), o
        else:
            a, b = refit_affine(x, w, grid, s, o)
        sc = (a / division_scale(d)).round().clamp(*grid.scale_codes).to(best[1].dtype)
        mn = mn0 if dmin is None else (b / division_scale(dmin)).round().clamp(*grid.min_codes).to(best[2].dtype)  # type: ignore[misc]
        best = _keep(best, grid_error(x, w, d * sc.float(), offset(mn), grid), sc, mn)
    assert best is not None
    return GGMLParams(p.d, p.dmin, best[1], None if p.mn is None else best[2])


def choose_params(W: torch.Tensor, grid: GGMLGrid, importance: torch.Tensor) -> GGMLParams:
    """Stored parameters of ``grid``'s type for ``W`` [N, K] (float32, K a multiple of the block) under per-column
    ``importance`` [K] (positive). Rows are independent: they are searched a chunk at a time, so the search's
    temporaries stay near the cache's size and memory never grows with the layer."""
    rows = max(1, CHUNK_ELEMENTS // W.shape[1])
    parts = [_choose(W[r : r + rows], grid, importance) for r in range(0, W.shape[0], rows)]
    if len(parts) == 1:
        return parts[0]

    def cat(field: str) -> torch.Tensor | None:
        values = [getattr(p, field) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return GGMLParams(torch.cat([p.d for p in parts]), cat("dmin"), cat("sc"), cat("mn"))


def _choose(W: torch.Tensor, grid: GGMLGrid, importance: torch.Tensor) -> GGMLParams:
    n, k = W.shape
    x = W.reshape(n, k // grid.sub, grid.sub)
    w = importance.reshape(1, k // grid.sub, grid.sub)
    if grid.scale_codes is None:
        return _direct(x, w, grid)
    fit = affine_fit(x, w, grid, AFFINE_SEARCHES) if grid.affine else symmetric_fit(x, w, grid, SYM_STEPS)
    blocks = (n, k // grid.type.block, grid.per_block)
    d, sc = _super_codes(fit.scale.reshape(blocks), fit.scale_weight.reshape(blocks), grid.scale_codes)
    dmin = mn = None
    if grid.affine:
        assert grid.min_codes is not None
        offset_weight = fit.offset_weight.expand_as(fit.offset).reshape(blocks)
        dmin, mn = _super_codes(fit.offset.reshape(blocks), offset_weight, grid.min_codes)
    return _refine(x, w, grid, GGMLParams(d, dmin, sc.reshape(n, -1), None if mn is None else mn.reshape(n, -1)))
