"""Exact multiple-choice knapsack (MCKP): per group one option, least summed error within a budget of bits.

:func:`solve_mckp` solves it exactly, for any integer costs:

1. Per unit, options that cost at least as much as another option without a lower error are dropped
   (never needed by an optimum), and each unit's cheapest cost is subtracted from costs and budget.
2. A sparse dynamic program over units keeps, after each unit, the Pareto set of partial solutions
   (total cost, total error): a state is dropped only when another has cost <= and error <=, since any
   completion of the dropped state completes the other at least as well. Costs are exact integers
   (bits), so there is no grid and no rounding; the state count is at most the number of distinct
   reachable costs (the GCD of the costs is implicit).
3. Bound pruning: a state is also dropped when its error plus a lower bound on the best completion of the
   remaining units within the remaining budget exceeds a known feasible solution (the incumbent). The lower
   bound is the LP relaxation of the remaining MCKP: greedy over the units' lower-convex-hull upgrades in
   order of error saved per bit, the last one taken fractionally; it is a piecewise-linear function of the
   remaining budget, precomputed per suffix of units and evaluated for all states at once. The incumbent
   comes from greedy rounding of the same LP plus improvement passes.

Both rules keep at least one optimal solution at every stage, so the minimum over the final states is
optimal (up to float rounding of summed errors; a relative tolerance keeps near-ties instead of pruning).
Measured errors fall steeply and irregularly with bits, so the LP bound is tight and the search stays small.
Only adversarial inputs (errors exactly proportional to costs: subset sum) leave the bound unable to prune; the
search then stops at ``MAX_STATES`` with a QuantkitError rather than run out of memory; it never returns a
non-optimal plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from quantkit.errors import QuantkitError

MAX_STATES = 1_000_000  # partial plans kept after one unit; real measurements keep a few thousand at most


@dataclass(slots=True)
class _Unit:
    index: np.ndarray  # original option indices, Pareto options only, by increasing cost
    cost: np.ndarray  # int64, reduced: cheapest option costs 0
    error: np.ndarray  # float64, strictly decreasing
    hull: list[tuple[int, float]]  # lower convex hull upgrades (delta cost > 0, delta error < 0), in order


def solve_mckp(costs: Sequence[Sequence[int]], errors: Sequence[Sequence[float]], budget: int) -> list[int] | None:
    """Exact MCKP: per group the option index minimising summed error with summed cost <= budget.

    None when even the cheapest choice exceeds the budget. Ties: the lower total cost wins.
    """
    return search_mckp(costs, errors, budget)[0]


def search_mckp(
    costs: Sequence[Sequence[int]], errors: Sequence[Sequence[float]], budget: int
) -> tuple[list[int] | None, int]:
    """:func:`solve_mckp`'s choice and the most partial plans the search kept after any unit (0: no search)."""
    if len(costs) != len(errors) or any(len(c) != len(e) or not c for c, e in zip(costs, errors, strict=True)):
        raise ValueError("costs and errors must have the same, non-empty option lists per group")
    if not costs:
        return [], 0
    units = [_pareto_unit(c, e) for c, e in zip(costs, errors, strict=True)]
    cap = int(budget) - sum(min(int(x) for x in c) for c in costs)
    if cap < 0:
        return None, 0
    if cap >= sum(int(u.cost[-1]) for u in units):  # everything fits: least error everywhere
        return [int(u.index[-1]) for u in units], 0
    bounds = _SuffixBounds(units)
    incumbent = _greedy_incumbent(units, cap)
    scale = sum(float(np.abs(u.error).max()) for u in units)
    picks, states = _sparse_dp(units, cap, bounds, incumbent + 1e-9 * scale + 1e-300)
    return [int(u.index[j]) for u, j in zip(units, picks, strict=True)], states


def _pareto_unit(costs: Sequence[int], errors: Sequence[float]) -> _Unit:
    """Options by increasing cost with strictly decreasing error (dominated options dropped)."""
    order = sorted(range(len(costs)), key=lambda j: (int(costs[j]), float(errors[j]), j))
    keep: list[int] = []
    for j in order:
        if not keep or float(errors[j]) < float(errors[keep[-1]]):
            keep.append(j)
    base = int(costs[keep[0]])
    cost = np.array([int(costs[j]) - base for j in keep], dtype=np.int64)
    error = np.array([float(errors[j]) for j in keep], dtype=np.float64)
    return _Unit(np.array(keep), cost, error, _hull_upgrades(cost, error))


def _hull_upgrades(cost: np.ndarray, error: np.ndarray) -> list[tuple[int, float]]:
    """Steps along the lower convex hull of (cost, error): error saved per bit decreases step by step."""
    hull = [0]
    for j in range(1, len(cost)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or above the segment a -> j (cross-multiplied slopes; costs increase)
            if (error[b] - error[a]) * (cost[j] - cost[a]) >= (error[j] - error[a]) * (cost[b] - cost[a]):
                hull.pop()
            else:
                break
        hull.append(j)
    return [(int(cost[b] - cost[a]), float(error[b] - error[a])) for a, b in itertools.pairwise(hull)]


class _SuffixBounds:
    """LP-relaxation lower bound of units[d:] as a function of the remaining budget, for every d."""

    def __init__(self, units: list[_Unit]) -> None:
        n = len(units)
        self.base = np.zeros(n + 1)  # summed error of the cheapest options of units[d:]
        self.xs: list[np.ndarray] = [np.zeros(1)] * (n + 1)
        self.ys: list[np.ndarray] = [np.zeros(1)] * (n + 1)
        dc: np.ndarray = np.zeros(0)
        de: np.ndarray = np.zeros(0)
        for d in range(n - 1, -1, -1):
            unit = units[d]
            self.base[d] = self.base[d + 1] + unit.error[0]
            if unit.hull:
                dc = np.concatenate([dc, [c for c, _ in unit.hull]])
                de = np.concatenate([de, [e for _, e in unit.hull]])
                order = np.argsort(de / dc, kind="stable")
                dc, de = dc[order], de[order]
            self.xs[d] = np.concatenate([[0.0], np.cumsum(dc)])
            self.ys[d] = np.concatenate([[0.0], np.cumsum(de)])

    def lower(self, d: int, remaining: np.ndarray) -> np.ndarray:
        """Lower bound on the error of units[d:] within ``remaining`` bits (>= 0), elementwise."""
        return self.base[d] + np.interp(remaining.astype(np.float64), self.xs[d], self.ys[d])


def _greedy_incumbent(units: list[_Unit], cap: int) -> float:
    """Error of a feasible solution: LP-greedy rounding, then single-unit improvement passes."""
    steps = sorted(((e / c, i, k) for i, u in enumerate(units) for k, (c, e) in enumerate(u.hull)), key=lambda s: s[0])
    hull_pos = [0] * len(units)  # hull steps taken per unit
    blocked = [False] * len(units)
    left = cap
    for _, i, k in steps:
        c = units[i].hull[k][0]
        if blocked[i] or hull_pos[i] != k or c > left:
            blocked[i] = True
            continue
        hull_pos[i], left = k + 1, left - c
    # hull position -> option position: option j reached after k hull steps
    pick = [int(np.searchsorted(u.cost, sum(c for c, _ in u.hull[: hull_pos[i]]))) for i, u in enumerate(units)]
    left = cap - sum(int(u.cost[j]) for u, j in zip(units, pick, strict=True))
    improved = True
    while improved:  # best single-unit move that fits, until none lowers the error
        improved, best = False, (0.0, -1, -1)
        for i, u in enumerate(units):
            room = left + int(u.cost[pick[i]])
            fits = np.nonzero(u.cost <= room)[0]
            j = int(fits[np.argmin(u.error[fits])])
            gain = float(u.error[pick[i]] - u.error[j])
            if gain > best[0]:
                best = (gain, i, j)
        if best[1] >= 0:
            _, i, j = best
            left += int(units[i].cost[pick[i]]) - int(units[i].cost[j])
            pick[i], improved = j, True
    return math.fsum(float(u.error[j]) for u, j in zip(units, pick, strict=True))


def _sparse_dp(units: list[_Unit], cap: int, bounds: _SuffixBounds, limit: float) -> tuple[list[int], int]:
    """Pareto-set DP with LP-bound pruning.

    Returns the chosen Pareto-option position per unit and the most states kept after any unit.
    """
    cost = np.zeros(1, dtype=np.int64)
    err = np.zeros(1, dtype=np.float64)
    history: list[tuple[np.ndarray, np.ndarray]] = []
    most = 0
    for d, unit in enumerate(units):
        if len(cost) > MAX_STATES:
            raise QuantkitError(
                f"the exact plan search kept {len(cost):,} partial plans after {d} units (limit {MAX_STATES:,}); "
                "this happens when errors are almost exactly proportional to bit costs, so bounds cannot prune; "
                "pin some units (--pin) or plan with fewer candidates"
            )
        k = len(unit.cost)
        new_cost = (cost[:, None] + unit.cost[None, :]).ravel()
        new_err = (err[:, None] + unit.error[None, :]).ravel()
        parent = np.repeat(np.arange(len(cost)), k)
        option = np.tile(np.arange(k), len(cost))
        ok = new_cost <= cap
        ok[ok] &= new_err[ok] + bounds.lower(d + 1, cap - new_cost[ok]) <= limit
        new_cost, new_err, parent, option = new_cost[ok], new_err[ok], parent[ok], option[ok]
        order = np.lexsort((new_err, new_cost))  # by cost, then error
        new_cost, new_err, parent, option = new_cost[order], new_err[order], parent[order], option[order]
        keep = np.ones(len(new_err), dtype=bool)
        keep[1:] = new_err[1:] < np.minimum.accumulate(new_err)[:-1]  # Pareto: strictly better than all cheaper
        cost, err = new_cost[keep], new_err[keep]
        most = max(most, len(cost))
        history.append((parent[keep], option[keep]))
    state = int(np.argmin(err))  # first minimum: the cheapest among equal errors
    picks = [0] * len(units)
    for d in range(len(units) - 1, -1, -1):
        parent, option = history[d]
        picks[d] = int(option[state])
        state = int(parent[state])
    return picks, most
