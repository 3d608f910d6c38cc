"""Mixed-precision planning: one candidate per unit, least summed predicted error within a storage budget.

This is a multiple-choice knapsack (MCKP), solved exactly by :func:`quantkit.mixed.mckp.solve_mckp`.

Budgets: ``target_bits`` is the average bits per weight over the measured units' params (budget =
floor(target_bits * params) bits); ``max_size_mb`` caps the measured units' storage at N megabytes with
1 MB = 1e6 bytes = 8e6 bits. Both may be given (the tighter one applies). Sizes cover the measured Linears' weight
tensors as ``quantkit inspect`` counts them; a whole-model budget (``outer_bits``, :mod:`quantkit.mixed.whole_model`)
also counts the embedding, the head, the norms and the biases against ``max_size_mb``.
"""

from __future__ import annotations

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
from quantkit.mixed.mckp import search_mckp
from quantkit.mixed.measurement import CandidateCost, Measurement

FRONTIER_POINTS = 24


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


@dataclass(frozen=True, slots=True)
class OuterUnit:
    """The head or the embedding offered to a whole-model plan: scheme spelling -> (bits, error); one option when
    the user gave the scheme, the measured ones (``sensitivity --outer``) when the planner chooses."""

    name: str  # "head" | "embedding"
    options: dict[str, CandidateCost]
    measured: bool = True  # False: a scheme the user gave, whose error was not measured (counted as 0)


@dataclass(frozen=True, slots=True)
class OuterChoice:
    name: str  # "head" | "embedding"
    scheme: str  # as --quantize-head / --quantize-embedding take it ("none": float)
    bits: int
    error: float | None  # predicted error (None: not measured)


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
    outer_bits: int = 0  # a whole-model budget's bits outside the measured linears and ``outer`` (0: the linears)
    outer: list[OuterChoice] = field(default_factory=list)  # the head's and the embedding's schemes, when planned
    untied_head: bool = False  # the plan pays for a head that the run unties (--rotate hadamard)

    @property
    def whole_model_mb(self) -> float:
        """The checkpoint's tensors in MB: the measured linears plus ``outer_bits`` and the outer choices."""
        return (self.total_bits + self.outer_bits + sum(o.bits for o in self.outer)) / BITS_PER_MB

    @property
    def whole_error(self) -> float:
        """The predicted error the plan minimises: the linears' plus the measured head's and embedding's."""
        return math.fsum([self.predicted_error, *(o.error or 0.0 for o in self.outer)])

    def outer_scheme(self, name: str) -> str | None:
        """The planned scheme of the head or the embedding; None when the plan does not set it."""
        return next((o.scheme for o in self.outer if o.name == name), None)

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
    outer_bits: int = 0,
    outer: Sequence[OuterUnit] = (),
    untied_head: bool = False,
) -> Plan:
    """The least-error assignment of one measured candidate per unit whose total bits fit the budget;
    ``outer_bits``: what the checkpoint holds outside the measured linears (:mod:`quantkit.mixed.whole_model`),
    taken from ``max_size_mb`` first, so that the whole checkpoint fits it; ``outer``: the head and the embedding
    as two more units of the same knapsack (their bits count against ``max_size_mb`` only)."""
    measurement.validate()
    if outer and (max_size_mb is None or target_bits is not None):
        raise QuantkitError("the head and the embedding are planned under a whole-model --max-size-mb budget alone")
    budget = budget_bits(measurement, target_bits=target_bits, max_size_mb=max_size_mb, outer_bits=outer_bits)
    allowed, pinned = _allowed_options(measurement, pins)
    costs, errors = _cost_tables(measurement, allowed)
    n_units = len(costs)
    outer_names = [list(o.options) for o in outer]
    costs += [[o.options[n].bits for n in names] for o, names in zip(outer, outer_names, strict=True)]
    errors += [[o.options[n].error for n in names] for o, names in zip(outer, outer_names, strict=True)]
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    if lo > budget:
        if (outer_bits or outer) and max_size_mb is not None and target_bits is None:
            outside = outer_bits + sum(min(c) for c in costs[n_units:])
            raise QuantkitError(_whole_model_message(max_size_mb, lo + outer_bits, outside))
        raise QuantkitError(_infeasible_message(budget, lo, hi, measurement.total_params, bool(pins)))
    choice, states = search_mckp(costs, errors, budget)
    assert choice is not None  # feasible: lo <= budget
    units = [
        UnitChoice(u.name, list(u.modules), u.params, allowed[i][j], errors[i][j], costs[i][j], pinned[i])
        for i, (u, j) in enumerate(zip(measurement.units, choice[: len(measurement.units)], strict=True))
    ]
    picks = choice[len(measurement.units) :]
    chosen = [
        OuterChoice(o.name, names[j], o.options[names[j]].bits, o.options[names[j]].error if o.measured else None)
        for o, names, j in zip(outer, outer_names, picks, strict=True)
    ]
    return Plan(
        measurement.model,
        measurement.mode,
        units,
        budget,
        target_bits,
        max_size_mb,
        list(pins),
        states,
        outer_bits,
        chosen,
        untied_head,
    )


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


def budget_bits(
    measurement: Measurement,
    *,
    target_bits: float | None = None,
    max_size_mb: float | None = None,
    outer_bits: int = 0,
) -> int:
    """The budget in bits: floor(target_bits x params) and/or floor(max_size_mb x 8e6) - outer_bits, the tighter
    one (``outer_bits``: a whole-model budget's bits outside the measured linears)."""
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
        budget = math.floor(Fraction(str(float(value))) * scale)  # decimal value as typed, no float error
        budgets.append(budget - outer_bits if scale == BITS_PER_MB else budget)
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


def _whole_model_message(max_size_mb: float, least: int, outside: int) -> str:
    """``least``: the smallest whole checkpoint in bits; ``outside``: the least of it outside the measured linears."""
    smallest = math.ceil(least / 8e3) / 1e3  # MB, rounded up: a budget of this size fits
    return (
        f"the whole checkpoint cannot fit {max_size_mb} MB: the smallest reachable is {smallest:.3f} MB, "
        f"{format_mb(outside / 8, decimals=3)} of it outside the measured linears (embedding, head, norms); raise "
        f"--max-size-mb to at least {smallest:.3f} or measure smaller candidates"
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
