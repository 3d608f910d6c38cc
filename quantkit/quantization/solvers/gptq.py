"""GPTQ (Frantar et al., 2022) as one pure function: weight + Hessian in, quantized weight out.

No hooks, no model walking, no I/O. The loop follows the reference implementation: columns are processed
in blocks of ``block_size``; inside a block each column is quantized and its error, scaled by the upper
Cholesky factor ``U`` of ``H^-1``, is spread over the remaining block columns; the rest of the matrix gets
one lazy batch update per block (``W[:, i2:] -= Err1 @ U[i1:i2, i2:]``).

Loss reported: ``sum_j err_j**2`` with ``err_j = (w_j - q_j) / U_jj``, which equals exactly
``tr((W - W_hat) H_damped (W - W_hat)^T)`` (the Hessian-weighted error of :func:`hessian_weighted_error`
under the damped Hessian, with dead columns zeroed). With ``H = 2 X^T X / n`` that is twice the mean
per-token squared output error (summed over output channels).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from quantkit.device import float64_device
from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.quantization.solvers.gptq_factor import Parking, all_finite, factor_in_place, fill_working
from quantkit.quantization.solvers.grid import (
    all_group_qparams,
    code_grid,
    compute_qparams,
    global_scale_of,
    quantize_rtn,
    round_codes_,
)

_RETRY_MIN_DAMP = 1e-4  # so that a failed damp=0 attempt is retried with some damping


class GPTQSettings(Protocol):
    """The options the solver reads (``quantization/methods/gptq.py`` holds them, with their defaults)."""

    damp: float  # fraction of mean(diag H) added to the diagonal
    block_size: int  # columns per lazy batch update
    damp_retries: int  # extra attempts, each with damp *= damp_growth
    damp_growth: float


@dataclass(slots=True)
class GPTQResult:
    weight: QuantizedWeight
    loss: float  # tr(dW H_damped dW^T); for the RTN fallback tr(dW H dW^T) on the given H (NaN if non-finite)
    damp: float  # relative damping finally used
    fell_back_to_rtn: bool


@dataclass(slots=True)
class _GroupPlan:
    """Which group each column (in processing order) uses, and the group parameter tables."""

    col_group: list[int]  # processing position -> group index
    dynamic_end: dict[int, int]  # processing position that starts a dynamic group -> end position (exclusive)
    scale: torch.Tensor  # float32 [N, G] ([1, 1] per tensor)
    zero: torch.Tensor | None  # int8 [N, G]
    g_idx: torch.Tensor | None  # int32 [K] in original column order
    global_scale: torch.Tensor | None = None  # NVFP4: the whole weight's, fixed before any column moves

    def set_params(self, g: int, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        self.scale[:, g] = scale[:, 0]
        if self.zero is not None and zero is not None:
            self.zero[:, g] = zero[:, 0]


def hessian_weighted_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor, chunk: int = 256) -> float:
    """``tr((W - W_hat) H (W - W_hat)^T)`` computed in float64 (on the CPU for a device without float64).

    ``H`` is converted ``chunk`` columns at a time, so no float64 copy of the whole [K, K] matrix is made.
    """
    where = float64_device(W.device)
    delta = W.detach().to(device=where, dtype=torch.float64)
    delta.sub_(W_hat.detach().to(device=where))  # in float64, with no float64 copy of W_hat
    total = torch.zeros((), dtype=torch.float64, device=where)
    for j0 in range(0, H.shape[1], chunk):
        h = H[:, j0 : j0 + chunk].detach().to(device=where, dtype=torch.float64)
        total += ((delta @ h) * delta[:, j0 : j0 + chunk]).sum()
    return float(total)


def _check_shapes(W: torch.Tensor, H: torch.Tensor) -> None:
    if W.ndim != 2:
        raise QuantkitError(f"GPTQ expects a 2-D weight [out, in], got shape {tuple(W.shape)}")
    k = W.shape[1]
    if tuple(H.shape) != (k, k):
        raise QuantkitError(f"Hessian shape {tuple(H.shape)} does not match weight in-features {k}")


def _factor_with_retries(
    H: torch.Tensor,
    perm: torch.Tensor | None,
    dead: torch.Tensor,
    config: GPTQSettings,
    parking: Parking | None = None,
) -> tuple[torch.Tensor | None, float]:
    """``U`` and the relative damp that worked; retries grow damp (from at least ``_RETRY_MIN_DAMP``).

    Every attempt factors exactly ``H' + damp * mean(diag H') * I``, where ``H'`` is ``H`` (float32, never modified)
    in processing order with dead columns isolated, built afresh in one working buffer (see gptq_factor). With
    ``parking``, H is parked while an attempt runs (and left parked).
    """
    damp = config.damp
    buf = fill_working(None, H, perm, dead)
    if not all_finite(buf):  # Cholesky reads one triangle only: check all of H up front
        return None, damp
    mean_diag = float(buf.diagonal().mean())
    for attempt in range(config.damp_retries + 1):
        if attempt:
            damp = max(damp * config.damp_growth, _RETRY_MIN_DAMP)
            if parking is not None:
                parking.unpark()
            fill_working(buf, H, perm, dead)  # the failed attempt spoiled the buffer
        if parking is not None:
            parking.park()
        buf.diagonal().add_(damp * mean_diag)
        U = factor_in_place(buf)
        if U is not None:
            return U, damp
    return None, damp


def _plan_groups(
    W: torch.Tensor, diag: torch.Tensor, perm: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype
) -> _GroupPlan:
    """Resolve the grouping mode once. ``W``/``diag`` are in original column order."""
    n, k = W.shape
    size = scheme.group_len(k)
    groups = scheme.num_groups(k)
    global_scale = global_scale_of(W, scheme)
    # fixed up front on the un-updated W, original column order: per channel, per tensor, block tiles (their
    # scales span rows of other columns too) and static groups
    if scheme.per_channel or scheme.per_tensor or scheme.block or scheme.static_groups:
        scale, zero = all_group_qparams(W, scheme, scale_dtype=scale_dtype, col_weight=diag, global_scale=global_scale)
        return _GroupPlan([c // size for c in perm.tolist()], {}, scale, zero, None, global_scale)
    scale = torch.empty(n, groups, device=W.device)
    zero = None if scheme.symmetric else torch.empty(n, groups, dtype=torch.int8, device=W.device)
    starts = {j: min(j + size, k) for j in range(0, k, size)}
    g_idx = None
    if scheme.act_order:  # groups formed in processing order: g_idx[perm[j]] = j // size
        g_idx = (torch.argsort(perm) // size).to(torch.int32)
    return _GroupPlan([j // size for j in range(k)], starts, scale, zero, g_idx, global_scale)


def _current_columns_t(
    WT: torch.Tensor, W1T: torch.Tensor, Err1T: torch.Tensor, U: torch.Tensor, i1: int, i: int, end: int
) -> torch.Tensor:
    """Columns ``[i1 + i, end)`` as [N, L], updated by every column already quantized (incl. this block's).

    ``WT``/``W1T``/``Err1T`` are transposed ([columns, N]): one column is one contiguous row.
    """
    i2 = i1 + W1T.shape[0]
    inside = W1T[i : min(end, i2) - i1]
    if end <= i2:
        return inside.T
    outside = WT[i2:end] - U[i1 : i1 + i, i2:end].T @ Err1T[:i]
    return torch.cat([inside, outside]).T


class _ColumnParams:
    """Scale and zero (float32, contiguous [N]) of each column in processing order."""

    def __init__(self, plan: _GroupPlan) -> None:
        self.plan = plan
        self.static = not plan.dynamic_end
        groups = torch.tensor(plan.col_group, device=plan.scale.device)
        # static groups: gathered once as [K, N] rows; dynamic: refreshed when a group's params are set
        self.scale_t = plan.scale.T[groups].contiguous() if self.static else None
        self.zero_t = None if plan.zero is None or not self.static else plan.zero.T[groups].float().contiguous()
        self.current: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def refresh(self, g: int) -> None:
        zero = None if self.plan.zero is None else self.plan.zero[:, g].float().contiguous()
        self.current = (self.plan.scale[:, g].contiguous(), zero)

    def __call__(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.static:
            assert self.scale_t is not None
            return self.scale_t[j], None if self.zero_t is None else self.zero_t[j]
        assert self.current is not None
        return self.current


def _gptq_loop(
    WT: torch.Tensor,
    U: torch.Tensor,
    diag: torch.Tensor,
    plan: _GroupPlan,
    scheme: QuantScheme,
    block_size: int,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, float]:
    """Quantize the weight, given as its transpose ``WT`` [K, N] in processing order (updated in place), column by
    column; returns the codes q [N, K] (:attr:`QuantScheme.code_dtype`) and the loss.

    Works on the transpose, so that every per-column operation reads and writes one contiguous row; the
    arithmetic is :func:`quantize` / :func:`dequantize`'s, on float32 codes (exact) instead of the code dtype.
    """
    k, n = WT.shape
    qT = torch.empty(k, n, dtype=scheme.code_dtype, device=WT.device)  # each column's codes, stored as computed
    q = torch.empty(n, device=WT.device)  # the current column's codes, in float32
    grid = code_grid(scheme, scale_dtype, plan.global_scale)
    params = _ColumnParams(plan)
    where = float64_device(WT.device)  # the loss is summed in float64: on the CPU where the device has none
    loss = torch.zeros((), dtype=torch.float64, device=where)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1T = WT[i1:i2].clone()
        Err1T = torch.zeros_like(W1T)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            end = plan.dynamic_end.get(j)
            if end is not None:
                g = plan.col_group[j]
                cols = _current_columns_t(WT, W1T, Err1T, U, i1, i, end)
                found = compute_qparams(
                    cols, scheme, scale_dtype=scale_dtype, col_weight=diag[j:end], global_scale=plan.global_scale
                )
                plan.set_params(g, *found)
                params.refresh(g)
            scale, zero = params(j)
            w, err = W1T[i], Err1T[i]
            torch.div(w, scale, out=q)
            if zero is None:
                round_codes_(q, grid)
                torch.mul(q, scale, out=err)
            else:
                q.round_().add_(zero).clamp_(scheme.qmin, scheme.qmax)
                torch.sub(q, zero, out=err).mul_(scale)
            qT[j].copy_(q)  # exact: integers in [qmin, qmax], or values of the float code format
            torch.sub(w, err, out=err).div_(U1[i, i])
            W1T[i:].addr_(U1[i, i:], err, alpha=-1.0)
        loss += Err1T.to(device=where, dtype=torch.float64).square().sum()
        WT[i2:].addmm_(U[i1:i2, i2:].T, Err1T, alpha=-1.0)
    return qT.T, float(loss)


def _rtn_fallback(
    W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype, damp: float, name: str
) -> GPTQResult:
    warnings.warn(
        f"GPTQ: the Hessian of layer '{name}' could not be factored even with damp={damp:g}; "
        "using round-to-nearest for this layer",
        RuntimeWarning,
        stacklevel=3,
    )
    weight = quantize_rtn(W, scheme, scale_dtype=scale_dtype)
    loss = hessian_weighted_error(W, weight.dequantize(), H) if all_finite(H) else float("nan")
    return GPTQResult(weight=weight, loss=loss, damp=damp, fell_back_to_rtn=True)


def gptq_solve(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    config: GPTQSettings,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
    name: str = "",
    overwrite: bool = False,
    parking: Callable[[torch.Tensor], Parking] | None = None,
) -> GPTQResult:
    """Quantize ``W`` [N, K] with GPTQ under Hessian ``H`` [K, K] (``2 X^T X / n``); inputs are not modified,
    except ``W`` with ``overwrite`` (a float32 copy the caller made for the call and keeps no reference to: it is
    worked on in place and freed early).

    Scales are rounded to ``scale_dtype`` before use, so the returned weight dequantizes exactly to what the
    solver compensated for. ``name`` only labels the warning when the layer falls back to round-to-nearest.
    ``parking``: given the float32 H the solver reads, what hands H's memory away while the solver holds its
    factor (the run's memory strategy decides how; H is back, unchanged, when the call returns), so that one
    [K, K] matrix is in memory at a time instead of two.
    """
    _check_shapes(W, H)
    H = H.detach().to(device=W.device, dtype=torch.float32)  # read, never written
    parked = _NotParked() if parking is None else parking(H)
    try:
        diag = H.diagonal().clone()
        dead = diag == 0  # columns never activated: zero weight, isolated in H (diagonal 1)
        diag[dead] = 1
        k = W.shape[1]
        act_order = scheme.act_order
        perm = torch.argsort(diag, descending=True, stable=True) if act_order else torch.arange(k, device=W.device)
        order = perm if act_order else None
        U, damp = _factor_with_retries(H, order, dead if order is None else dead[order], config, parked)
        if U is None:
            parked.unpark()
            return _rtn_fallback(W.detach().float(), H.detach().float(), scheme, scale_dtype, damp, name)
        W = W.detach().float() if overwrite else W.detach().float().clone()
        if bool(dead.any()):
            W[:, dead] = 0
        plan = _plan_groups(W, diag, perm, scheme, scale_dtype)
        WT = (W.T[perm] if act_order else W.T).contiguous()  # processing order, one column per row
        del W
        qint, loss = _gptq_loop(WT, U, diag[perm], plan, scheme, config.block_size, scale_dtype)
        del U, WT
    finally:
        parked.unpark()
    qweight = qint[:, torch.argsort(perm)].contiguous() if act_order else qint
    weight = QuantizedWeight(qweight, plan.scale, plan.zero, plan.g_idx, scheme, global_scale=plan.global_scale)
    return GPTQResult(weight=weight, loss=loss, damp=damp, fell_back_to_rtn=False)


class _NotParked:
    """No memory strategy: H stays where it is."""

    def park(self) -> None:
        pass

    def unpark(self) -> None:
        pass
