"""Mixed-precision planning: one candidate per unit, least summed predicted error within a storage budget.

This is a multiple-choice knapsack (MCKP). :func:`solve_mckp` solves it exactly, for any integer costs:

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
Measured errors fall steeply and irregularly with bits, so the LP bound is tight and a few hundred units
plan in milliseconds. Only adversarial inputs (errors exactly proportional to costs: subset sum) leave the
bound unable to prune; the search then stops at ``MAX_STATES`` with a QuantkitError rather than run out
of memory; it never returns a non-optimal plan.

Budgets: ``target_bits`` is the average bits per weight over the measured units' params (budget =
floor(target_bits * params) bits); ``max_size_mb`` caps the measured units' storage at N megabytes with
1 MB = 1e6 bytes = 8e6 bits. Both may be given (the tighter one applies). Sizes cover only the measured
Linears' weight tensors as ``quantkit inspect`` counts them (embeddings, norms, biases excluded).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.format.sizes import BITS_PER_MB, format_mb
from quantkit.mixed.candidates import parse_candidate
from quantkit.mixed.measurement import Measurement

FRONTIER_POINTS = 24
MAX_STATES = 1_000_000  # partial plans kept after one unit; real measurements keep a few thousand at most


@dataclass(slots=True)
class UnitChoice:
    name: str
    modules: list[str]
    params: int
    candidate: str
    error: float  # predicted error of the chosen candidate
    bits: int  # exact storage bits of the chosen candidate
    pinned: bool = False

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.params

    @property
    def scheme(self) -> QuantScheme | None:
        return parse_candidate(self.candidate)


@dataclass(slots=True)
class Plan:
    model: str
    mode: str
    units: list[UnitChoice]
    budget_bits: int
    target_bits: float | None = None
    max_size_mb: float | None = None
    pins: list[tuple[str, str]] = field(default_factory=list)
    search_states: int = 0  # most partial plans the exact search kept after any unit (0: no search was needed)

    @property
    def total_bits(self) -> int:
        return sum(u.bits for u in self.units)

    @property
    def total_params(self) -> int:
        return sum(u.params for u in self.units)

    @property
    def bits_per_weight(self) -> float:
        return self.total_bits / self.total_params

    @property
    def size_mb(self) -> float:
        return self.total_bits / BITS_PER_MB

    @property
    def predicted_error(self) -> float:
        return math.fsum(u.error for u in self.units)


@dataclass(frozen=True, slots=True)
class UniformPoint:
    """Every measured unit on one candidate: the uniform scheme a plan is compared with."""

    candidate: str
    bits: int  # exact storage bits of the measured units
    params: int
    predicted_error: float  # summed over the units, as a plan's

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.params

    @property
    def size_mb(self) -> float:
        return self.bits / BITS_PER_MB


# --------------------------------------------------------------------------------------------------
# Public planning API
# --------------------------------------------------------------------------------------------------


def plan(
    measurement: Measurement,
    *,
    target_bits: float | None = None,
    max_size_mb: float | None = None,
    pins: Sequence[tuple[str, str]] = (),
) -> Plan:
    """The least-error assignment of one measured candidate per unit whose total bits fit the budget."""
    measurement.validate()
    budget = budget_bits(measurement, target_bits=target_bits, max_size_mb=max_size_mb)
    allowed, pinned = _allowed_options(measurement, pins)
    costs, errors = _cost_tables(measurement, allowed)
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    if lo > budget:
        raise QuantkitError(_infeasible_message(budget, lo, hi, measurement.total_params, bool(pins)))
    choice, states = _solve_mckp(costs, errors, budget)
    assert choice is not None  # feasible: lo <= budget
    units = [
        UnitChoice(u.name, list(u.modules), u.params, allowed[i][j], errors[i][j], costs[i][j], pinned[i])
        for i, (u, j) in enumerate(zip(measurement.units, choice, strict=True))
    ]
    return Plan(measurement.model, measurement.mode, units, budget, target_bits, max_size_mb, list(pins), states)


def reachable_bits(measurement: Measurement, pins: Sequence[tuple[str, str]] = ()) -> tuple[int, int]:
    """Smallest and largest total bits any plan can have, given the pins."""
    allowed, _ = _allowed_options(measurement, pins)
    costs, _ = _cost_tables(measurement, allowed)
    return sum(min(c) for c in costs), sum(max(c) for c in costs)


def plan_frontier(
    measurement: Measurement, budgets: Iterable[float] | None = None, pins: Sequence[tuple[str, str]] = ()
) -> list[Plan]:
    """Optimal plans for several bits-per-weight targets (default: evenly spaced over the reachable range).

    Targets below the smallest reachable size are skipped.
    """
    lo, hi = reachable_bits(measurement, pins)
    params = measurement.total_params
    if budgets is None:
        budgets = np.linspace(lo / params, hi / params, FRONTIER_POINTS).tolist()
        # the end points rounded up, so floor(target * params) still reaches lo and hi
        budgets[0], budgets[-1] = (math.ceil(b / params * 1e9) / 1e9 for b in (lo, hi))
    plans = []
    for target in budgets:
        if math.floor(Fraction(str(float(target))) * params) >= lo:
            plans.append(plan(measurement, target_bits=float(target), pins=pins))
    return plans


def uniform_points(measurement: Measurement) -> list[UniformPoint]:
    """The uniform schemes among the candidates (those measured on every unit), fewest bits first."""
    points = [
        UniformPoint(
            name,
            sum(u.options[name].bits for u in measurement.units),
            measurement.total_params,
            math.fsum(u.options[name].error for u in measurement.units),
        )
        for name in measurement.candidates
        if all(name in u.options for u in measurement.units)
    ]
    return sorted(points, key=lambda p: (p.bits, p.candidate))


def budget_bits(measurement: Measurement, *, target_bits: float | None = None, max_size_mb: float | None = None) -> int:
    """The budget in bits: floor(target_bits x params) and/or floor(max_size_mb x 8e6), the tighter one."""
    if target_bits is None and max_size_mb is None:
        raise QuantkitError("no budget given; pass target_bits (e.g. 4.5 bits per weight) or max_size_mb")
    budgets = []
    for value, label, scale in (
        (target_bits, "target bits per weight", measurement.total_params),
        (max_size_mb, "maximum size in MB", BITS_PER_MB),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise QuantkitError(f"the {label} must be a positive number, got {value!r}")
        budgets.append(math.floor(Fraction(str(float(value))) * scale))  # decimal value as typed, no float error
    return min(budgets)


def parse_pin(text: str) -> tuple[str, str]:
    """``"<regex>=<candidate>"`` (split at the last ``=``), e.g. ``"down_proj$=int8"``, as a (regex, candidate) pin."""
    pattern, sep, candidate = text.rpartition("=")
    if not sep or not pattern or not candidate:
        raise QuantkitError(f"pin {text!r} must look like <regex>=<candidate>, e.g. 'layers\\.0\\.=fp16'")
    parse_candidate(candidate)
    return pattern, candidate.strip()


def _infeasible_message(budget: int, lo: int, hi: int, params: int, pinned: bool) -> str:
    def size(bits: int) -> str:
        return f"{bits / params:.4f} bits/weight ({format_mb(bits / 8, decimals=3)})"

    given = " with the given pins" if pinned else ""
    return (
        f"the budget of {size(budget)} cannot be met{given}: the smallest reachable size is {size(lo)} and the "
        f"largest is {size(hi)}; raise the budget to at least {size(lo)}"
        + (" or relax the pins" if pinned else " or measure smaller candidates")
    )


def _allowed_options(measurement: Measurement, pins: Sequence[tuple[str, str]]) -> tuple[list[list[str]], list[bool]]:
    """Per unit, the candidate names it may take (measured order; the pinned one only when pinned)."""
    allowed = [[c for c in measurement.candidates if c in u.options] for u in measurement.units]
    pinned = [False] * len(measurement.units)
    for pattern, candidate in pins:  # later pins override earlier ones
        regex = _compile_pin(pattern)
        if candidate not in measurement.candidates:
            raise QuantkitError(
                f"pin {pattern!r} -> {candidate!r}: {candidate!r} was not measured; "
                f"pin one of {measurement.candidates} or re-run `quantkit sensitivity` with it"
            )
        hits = [i for i, u in enumerate(measurement.units) if _unit_matches(regex, u.name, u.modules)]
        if not hits:
            raise QuantkitError(f"pin {pattern!r} matches no measured unit or module; check the regular expression")
        for i in hits:
            unit = measurement.units[i]
            if candidate not in unit.options:
                raise QuantkitError(f"pin {pattern!r} -> {candidate!r}: unit {unit.name} has no measurement for it")
            allowed[i], pinned[i] = [candidate], True
    return allowed, pinned


def _compile_pin(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise QuantkitError(f"pin {pattern!r} is not a valid regular expression: {exc}") from exc


def _unit_matches(regex: re.Pattern[str], name: str, modules: Iterable[str]) -> bool:
    return regex.search(name) is not None or any(regex.search(m) for m in modules)


def _cost_tables(measurement: Measurement, allowed: list[list[str]]) -> tuple[list[list[int]], list[list[float]]]:
    costs = [[u.options[c].bits for c in names] for u, names in zip(measurement.units, allowed, strict=True)]
    errors = [[u.options[c].error for c in names] for u, names in zip(measurement.units, allowed, strict=True)]
    return costs, errors


# --------------------------------------------------------------------------------------------------
# Exact multiple-choice knapsack
# --------------------------------------------------------------------------------------------------


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
    return _solve_mckp(costs, errors, budget)[0]


def _solve_mckp(
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
