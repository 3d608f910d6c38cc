"""Rounding onto a GGML type's grid, and the float parameter search that precedes the stored codes.

A weight [N, K] is viewed as sub-blocks ``x`` [N, S, sub] (S = K / sub) with per-weight importance ``w`` [1, S, sub]
(one number per input column, llama.cpp's imatrix or diag(H)). On fixed effective parameters ``s``/``o`` [N, S] a
weight's level is ``clamp(round((x + o) / s))`` (IQ4_NL: the nearest codebook level), the decoded value
``s * level - o``; a zero scale decodes every weight of its sub-block to ``-o`` (``s`` is replaced by infinity in the
division, so the level is finite and irrelevant).

The float search is the importance-weighted MSE clipping of llama.cpp's ``make_qx_quants`` (symmetric grids) and
``make_qkx2/3_quants`` (grids with a min): for each candidate inverse scale (the range stretched or shrunk by a step),
round, refit scale (and min) by weighted least squares on those levels. Symmetric grids keep the candidate with the
best least-squares score, as llama.cpp does; grids with a min keep the one whose round-to-nearest error is lowest,
and also try ranges that start above the min (the weights near zero on level 0 instead of straddling levels 0 and 1,
which an outlier on the other side otherwise forces). The error weights are the importance alone (uniform without
one), not llama.cpp's ``sqrt(sigma^2 + x^2)`` heuristics, so the search minimizes the error the solver reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from quantkit.format.ggml.grids import GGMLGrid

F16_MAX = 65504.0
_TINY = 1e-30
_LUT_HALF = 256  # |2 t| beyond the codebook's ends (+-127) rounds to an end level


def division_scale(s: torch.Tensor) -> torch.Tensor:
    """``s`` with zeros replaced by infinity: the divisor that rounds a zero-scale sub-block's weights to level 0."""
    return torch.where(s == 0, torch.full_like(s, float("inf")), s)


def codebook_lut(grid: GGMLGrid) -> torch.Tensor:
    """float32 [2 * _LUT_HALF + 1]: the nearest codebook level of t, indexed by ``ceil(2 t) + _LUT_HALF``.

    The codebook's midpoints are multiples of 1/2 (integer levels), so ``ceil(2 t)`` decides exactly which midpoints
    lie below t: the same choice as a search over the midpoints (a tie goes to the lower level), at the cost of a
    table lookup."""
    v = grid.level_values
    twice_mids = (v[1:] + v[:-1]).long()  # 2 * midpoint, an integer
    u = torch.arange(-_LUT_HALF, _LUT_HALF + 1)
    return v[(twice_mids.unsqueeze(0) < u.unsqueeze(1)).sum(1)]


def round_levels_(t: torch.Tensor, grid: GGMLGrid, lut: torch.Tensor | None = None) -> torch.Tensor:
    """Levels of scaled values ``t = (x + o) / s`` (float32), rounded in place on uniform grids."""
    if grid.codebook is None:
        return t.round_().clamp_(grid.lo, grid.hi)
    lut = codebook_lut(grid) if lut is None else lut
    return lut[t.mul_(2).ceil_().clamp_(-_LUT_HALF, _LUT_HALF).long().add_(_LUT_HALF)]


def grid_levels(x: torch.Tensor, s: torch.Tensor, o: torch.Tensor, grid: GGMLGrid) -> torch.Tensor:
    """Levels of ``x`` [..., sub] on fixed effective parameters ``s``/``o`` [...] (same arithmetic as GPTQ's loop)."""
    t = (x + o.unsqueeze(-1)) / division_scale(s).unsqueeze(-1)
    return round_levels_(t, grid)


def grid_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, o: torch.Tensor, grid: GGMLGrid) -> torch.Tensor:
    """Weighted squared error [...] of round-to-nearest on fixed parameters (per sub-block)."""
    v = grid_levels(x, s, o, grid).mul_(s.unsqueeze(-1)).sub_(o.unsqueeze(-1))
    return v.sub_(x).square_().mul_(w).sum(-1)


@dataclass(slots=True)
class FloatFit:
    """Per sub-block float parameters [N, S] and the curvatures of the error in them (for the stored codes)."""

    scale: torch.Tensor  # signed on symmetric grids
    offset: torch.Tensor  # o >= 0 (w = scale * level - o); zeros on symmetric grids
    scale_weight: torch.Tensor  # sum w * level^2: error growth per squared scale deviation
    offset_weight: torch.Tensor  # sum w


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each sub-block [N, S], never exactly zero."""
    mx = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)
    return torch.where(mx == 0, torch.full_like(mx, _TINY), mx)


def symmetric_candidates(
    x: torch.Tensor, w: torch.Tensor, grid: GGMLGrid, deltas: tuple[float, ...]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each step: (raw scale, least-squares scale, its score sumlx^2/suml2, suml2), all [N, S].

    The largest-magnitude weight maps to ``-(nmax + delta)`` (nmax = -lo, the grid's longer side), as llama.cpp
    maps it; IQ4_NL's codebook instead tries both ends (-127 and 113)."""
    mx = _signed_absmax(x)
    ends = (float(grid.lo),) if grid.codebook is None else (-127.0, 113.0)
    lut = codebook_lut(grid) if grid.codebook is not None else None
    for end in ends:
        for delta in deltas:
            raw = mx / (end - delta if end < 0 else end + delta)
            lv = round_levels_(x / raw.unsqueeze(-1), grid, lut)
            wl = lv * w
            sumlx = (wl * x).sum(-1)
            suml2 = (wl * lv).sum(-1)
            ok = suml2 > 0
            ls = torch.where(ok, sumlx / suml2.clamp_min(_TINY), raw)
            score = torch.where(ok, sumlx.square() / suml2.clamp_min(_TINY), torch.zeros_like(sumlx))
            yield raw, ls, score, suml2


def symmetric_fit(x: torch.Tensor, w: torch.Tensor, grid: GGMLGrid, deltas: tuple[float, ...]) -> FloatFit:
    """The candidate with the highest ``sumlx^2 / suml2`` (= the lowest error at its least-squares scale)."""
    best = None
    for _, ls, score, suml2 in symmetric_candidates(x, w, grid, deltas):
        if best is None:
            best = [ls, score, suml2]
            continue
        better = score > best[1]
        best = [torch.where(better, a, b) for a, b in zip((ls, score, suml2), best, strict=True)]
    assert best is not None
    zero = torch.zeros_like(best[0])
    return FloatFit(best[0], zero, best[2], w.sum(-1).expand_as(zero))


def affine_candidates(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: GGMLGrid,
    steps: tuple[float, ...],
    *,
    min_below_zero: bool,
    anchor: float = 1.0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each step: (scale, offset, sum w l^2), scale and offset [N, S] from a weighted least-squares fit of
    ``x ~ scale * level - offset`` on the levels of the range [anchor * min, max] stretched by the step. The first
    candidate is that range's plain grid. ``min_below_zero``: K-quants store a non-negative offset (the min is at
    most 0). ``anchor`` < 1 starts the range above the min (the lowest weights clip to level 0): with an outlier on
    one side, the weights near zero are better served by level 0 than by straddling levels 0 and 1."""
    nmax = float(grid.hi)
    lo = x.amin(-1)
    if min_below_zero:
        lo = lo.clamp_max(0)
    lo = lo * anchor
    span = x.amax(-1) - lo
    span = torch.where(span > 0, span, torch.ones_like(span))
    sw = w.sum(-1).expand_as(lo)
    sx = (w * x).sum(-1)
    xs = x - lo.unsqueeze(-1)
    raw_scale = span / nmax
    for step in (None, *steps):
        lv = (xs * ((nmax + (step or 0.0)) / span).unsqueeze(-1)).round_().clamp_(0, nmax)
        wl = lv * w
        sl, sl2, sxl = wl.sum(-1), (wl * lv).sum(-1), (wl * x).sum(-1)
        if step is None:
            yield raw_scale, -lo, sl2
            continue
        det = sw * sl2 - sl * sl
        ok = det > 0
        det = det.clamp_min(_TINY)
        scale = (sw * sxl - sx * sl) / det
        mn = (sl2 * sx - sl * sxl) / det
        if min_below_zero:
            pos = mn > 0
            scale = torch.where(pos, sxl / sl2.clamp_min(_TINY), scale)
            mn = torch.where(pos, torch.zeros_like(mn), mn)
        yield torch.where(ok, scale, raw_scale), torch.where(ok, -mn, -lo), sl2


def affine_fit(
    x: torch.Tensor,
    w: torch.Tensor,
    grid: GGMLGrid,
    searches: tuple[tuple[float, tuple[float, ...]], ...],
    *,
    min_below_zero: bool = True,
) -> FloatFit:
    """The candidate with the lowest weighted error of round-to-nearest on its (float) scale and offset, over
    ``searches`` = (anchor, steps) pairs (see :func:`affine_candidates`)."""
    best = None
    for anchor, steps in searches:
        for scale, off, sl2 in affine_candidates(x, w, grid, steps, min_below_zero=min_below_zero, anchor=anchor):
            scale = scale.clamp_min(0)
            off = off.clamp_min(0) if min_below_zero else off
            err = grid_error(x, w, scale, off, grid)
            if best is None:
                best = [err, scale, off, sl2]
                continue
            better = err < best[0]
            best = [torch.where(better, a, b) for a, b in zip((err, scale, off, sl2), best, strict=True)]
    assert best is not None
    return FloatFit(best[1], best[2], best[3], w.sum(-1).expand_as(best[1]))


def refit_affine(
    x: torch.Tensor, w: torch.Tensor, grid: GGMLGrid, s: torch.Tensor, o: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least-squares ``(scale, offset)`` [N, S] for the levels ``x`` rounds to on ``s``/``o`` (unchanged
    where the levels are all equal)."""
    lv = grid_levels(x, s, o, grid)
    wl = lv * w
    sw, sx = w.sum(-1).expand_as(s), (w * x).sum(-1)
    sl, sl2, sxl = wl.sum(-1), (wl * lv).sum(-1), (wl * x).sum(-1)
    det = sw * sl2 - sl * sl
    ok = det > 1e-12 * sw * sl2
    det = det.clamp_min(_TINY)
    scale = torch.where(ok, (sw * sxl - sx * sl) / det, s)
    off = torch.where(ok, -(sl2 * sx - sl * sxl) / det, o)
    return scale, off


def refit_symmetric(x: torch.Tensor, w: torch.Tensor, grid: GGMLGrid, s: torch.Tensor) -> torch.Tensor:
    """Weighted least-squares scale [N, S] for the levels ``x`` rounds to on ``s`` (unchanged where all are 0)."""
    lv = grid_levels(x, s, torch.zeros_like(s), grid)
    wl = lv * w
    sl2 = (wl * lv).sum(-1)
    return torch.where(sl2 > 0, (wl * x).sum(-1) / sl2.clamp_min(_TINY), s)
