"""GPTQ (and round-to-nearest) on llama.cpp's own grids: the bytes llama.cpp stores, chosen by the solver.

The stored parameters (fp16 super-block scales, 6/8-bit sub-block scale and min codes, or the 32-block's fp16
scale) are chosen first, on the float weights under per-column importance (:mod:`ggml_params`), and decoded to the
effective ``s``/``o`` of every sub-block exactly as llama.cpp decodes them. The GPTQ loop then rounds each column
against those fixed numbers (``level = clamp(round((w + o) / s))``, IQ4_NL: the nearest codebook level) and feeds the
error of ``s * level - o``, the value llama.cpp will compute, to the columns not yet quantized. Parameters are tied
to original column positions, so act-order (descending diag(H)) reorders columns without moving a sub-block.

The loop has the shape of :mod:`gptq` (lazy block updates, upper Cholesky factor of H^-1, damping retries, RTN
fallback) and reuses its factorization helpers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from quantkit.device import float64_device
from quantkit.errors import QuantkitError
from quantkit.format.ggml.grids import GGML_GRIDS, GGMLGrid, GGMLParams, codes_of, dequantize, effective, levels_of
from quantkit.format.ggml.pack import encode
from quantkit.format.ggml.types import fits, ggml_type
from quantkit.quantization.solvers.ggml_grid import codebook_lut, division_scale, grid_levels, round_levels_
from quantkit.quantization.solvers.ggml_params import choose_params
from quantkit.quantization.solvers.gptq import GPTQSettings, _factor_with_retries, hessian_weighted_error
from quantkit.quantization.solvers.gptq_factor import all_finite

_IMPORTANCE_FLOOR = 1e-6  # relative to the mean: a column nobody reads still gets a tie-breaking weight


@dataclass(slots=True)
class GGMLSolveResult:
    data: np.ndarray  # uint8 [N, row_bytes]: the bytes llama.cpp stores for this tensor (rows = the weight's rows)
    dequantized: torch.Tensor  # float32 [N, K]: bit-identical to gguf.quants.dequantize(data, qtype)
    loss: float  # GPTQ: tr(dW H_damped dW^T); RTN: tr(dW diag(importance / mean) dW^T); fallback: tr(dW H dW^T)
    damp: float
    fell_back_to_rtn: bool
    params: GGMLParams | None = None  # the stored parameters (codes as llama.cpp keeps them)


def _grid_for(W: torch.Tensor, type_name: str) -> GGMLGrid:
    t = ggml_type(type_name)
    if W.ndim != 2:
        raise QuantkitError(f"{t.name} quantization expects a 2-D weight [out, in], got shape {tuple(W.shape)}")
    if not fits(t, W.shape[1]):
        raise QuantkitError(
            f"{t.name} needs rows that are a multiple of {t.block} weights, this weight has {W.shape[1]}: "
            "use a 32-block type (Q5_0, Q5_1, Q8_0, IQ4_NL, ...) for it, as llama.cpp's fallback does"
        )
    if not bool(torch.isfinite(W).all()):
        raise QuantkitError(f"the weight to quantize as {t.name} has NaN or infinite entries: fix the model first")
    return GGML_GRIDS[t.name]


def _importance(importance: torch.Tensor | None, k: int) -> torch.Tensor:
    """Per-column weights normalized to mean 1 (ones without any), with a small floor so none is exactly zero."""
    imp = torch.ones(k) if importance is None else importance.detach().float().cpu().reshape(-1)
    if (importance is not None and imp.numel() != k) or not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise QuantkitError(
            f"importance must be {k} finite non-negative numbers (one per input column), got shape "
            f"{tuple(importance.shape)}: pass the imatrix / diag(H) of this layer's inputs"
        )
    mean = float(imp.mean())
    return (imp / mean if mean > 0 else torch.ones(k)) + _IMPORTANCE_FLOOR


def _finish(grid: GGMLGrid, params: GGMLParams, codes: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    return encode(grid.type, params, codes.numpy()), dequantize(grid, params, codes)


def _offsets(s: torch.Tensor, o: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros_like(s) if o is None else o


def _rtn(W: torch.Tensor, grid: GGMLGrid, imp: torch.Tensor) -> tuple[GGMLParams, torch.Tensor]:
    params = choose_params(W, grid, imp)
    s, o = effective(grid, params)
    n, k = W.shape
    levels = grid_levels(W.reshape(n, -1, grid.sub), s, _offsets(s, o), grid)
    return params, codes_of(grid, levels.reshape(n, k))


def ggml_rtn(W: torch.Tensor, type_name: str, *, importance: torch.Tensor | None = None) -> GGMLSolveResult:
    """Round-to-nearest on ``type_name``'s grid with parameters chosen under ``importance`` [K] (uniform if None)."""
    grid = _grid_for(W, type_name)
    Wf = W.detach().float().cpu()
    imp = _importance(importance, Wf.shape[1])
    params, codes = _rtn(Wf, grid, imp)
    data, deq = _finish(grid, params, codes)
    loss = float(((Wf - deq).double().square() * imp.double()).sum())
    return GGMLSolveResult(data, deq, loss, 0.0, False, params)


def _gptq_loop(
    WT: torch.Tensor, U: torch.Tensor, sT: torch.Tensor, oT: torch.Tensor, grid: GGMLGrid, block_size: int
) -> tuple[torch.Tensor, float]:
    """Levels [K, N] of ``WT`` [K, N] (processing order, updated in place) on per-column ``sT``/``oT`` [K, N]."""
    k, n = WT.shape
    levels = torch.empty(k, n)
    divT = division_scale(sT)
    lut = codebook_lut(grid) if grid.codebook is not None else None
    q = torch.empty(n)
    loss = torch.zeros((), dtype=torch.float64, device=float64_device(WT.device))
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1T = WT[i1:i2].clone()
        Err1T = torch.zeros_like(W1T)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            w, err = W1T[i], Err1T[i]
            torch.add(w, oT[j], out=q).div_(divT[j])  # the same arithmetic as grid_levels
            lv = round_levels_(q, grid, lut)
            levels[j] = lv
            torch.mul(lv, sT[j], out=err).sub_(oT[j])  # the value llama.cpp decodes
            torch.sub(w, err, out=err).div_(U1[i, i])
            W1T[i:].addr_(U1[i, i:], err, alpha=-1.0)
        loss += Err1T.double().square().sum()
        WT[i2:].addmm_(U[i1:i2, i2:].T, Err1T, alpha=-1.0)
    return levels, float(loss)


def ggml_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    type_name: str,
    config: GPTQSettings,
    *,
    act_order: bool = False,
    importance: torch.Tensor | None = None,
    name: str = "",
) -> GGMLSolveResult:
    """GPTQ on ``type_name``'s grid under Hessian ``H`` [K, K]; parameters chosen under ``importance`` [K]
    (diag(H) when None) before the column loop. Inputs are not modified."""
    grid = _grid_for(W, type_name)
    k = W.shape[1]
    if tuple(H.shape) != (k, k):
        raise QuantkitError(f"Hessian shape {tuple(H.shape)} does not match weight in-features {k}")
    H = H.detach().float().cpu()
    diag = H.diagonal().clone()
    dead = diag == 0  # columns never activated: zero weight, isolated in H
    if importance is None:  # diag(H), or uniform where H is not finite (the layer then falls back to RTN)
        importance = diag.clamp_min(0) if bool(torch.isfinite(diag).all()) else None
    imp = _importance(importance, k)
    perm = torch.argsort(diag, descending=True, stable=True) if act_order else torch.arange(k)
    order = perm if act_order else None
    U, damp = _factor_with_retries(H, order, dead if order is None else dead[order], config)
    Wf = W.detach().float().cpu().clone()
    if U is None:
        warnings.warn(
            f"GPTQ ({grid.name}): the Hessian of layer '{name}' could not be factored even with damp={damp:g}; "
            "using round-to-nearest for this layer",
            RuntimeWarning,
            stacklevel=2,
        )
        result = ggml_rtn(Wf, grid.name, importance=imp)
        result.loss = hessian_weighted_error(Wf, result.dequantized, H) if all_finite(H) else float("nan")
        result.damp, result.fell_back_to_rtn = damp, True
        return result
    if bool(dead.any()):
        Wf[:, dead] = 0
    params = choose_params(Wf, grid, imp)
    s, o = effective(grid, params)
    sT = s.repeat_interleave(grid.sub, dim=1).T[perm].contiguous()
    oT = _offsets(s, o).repeat_interleave(grid.sub, dim=1).T[perm].contiguous()
    WT = Wf.T[perm].contiguous()
    levelsT, loss = _gptq_loop(WT, U, sT, oT, grid, config.block_size)
    levels = levelsT[torch.argsort(perm)].T.contiguous() if act_order else levelsT.T.contiguous()
    codes = codes_of(grid, levels)
    data, deq = _finish(grid, params, codes)
    assert torch.equal(levels_of(grid, codes), levels)
    return GGMLSolveResult(data, deq, loss, damp, False, params)
