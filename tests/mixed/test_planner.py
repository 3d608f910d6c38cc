"""The planner: exact optimum (vs brute force), budgets, pins, infeasible budgets, speed, frontier and plot."""

from __future__ import annotations

import itertools
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from quantkit.errors import QuantkitError
from quantkit.mixed.candidates import parse_candidate, unit_storage_bits
from quantkit.mixed.mckp import solve_mckp
from quantkit.mixed.measurement import CandidateCost, Measurement, UnitMeasurement
from quantkit.mixed.planner import budget_bits, parse_pin, plan, plan_frontier, reachable_bits

CANDS = ["int3-g64", "int4-g128", "int4-g64", "int8", "fp16"]
SMOL_SHAPES = {  # SmolLM2-135M: (out, in)
    "self_attn.q_proj": (576, 576),
    "self_attn.k_proj": (192, 576),
    "self_attn.v_proj": (192, 576),
    "self_attn.o_proj": (576, 576),
    "mlp.gate_proj": (1536, 576),
    "mlp.up_proj": (1536, 576),
    "mlp.down_proj": (576, 1536),
}
FUSED = {
    "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
}


def smollm2_measurement(fused: bool = True, seed: int = 0, layers: int = 30) -> Measurement:
    """Realistic costs (exact storage bits) and errors ~ params x sensitivity x 4^-bits, with noise."""
    rng = random.Random(seed)
    if fused:
        unit_modules = {**FUSED, "o_proj": ["self_attn.o_proj"], "down_proj": ["mlp.down_proj"]}
    else:
        unit_modules = {name.split(".")[-1]: [name] for name in SMOL_SHAPES}
    units = []
    for layer in range(layers):
        for unit, rel in unit_modules.items():
            shapes = [SMOL_SHAPES[r] for r in rel]
            params = sum(n * k for n, k in shapes)
            sensitivity = rng.lognormvariate(0, 1) * (4 if layer < 2 else 1)
            options = {}
            for cand in CANDS:
                scheme = parse_candidate(cand)
                err = 0.0 if scheme is None else params * sensitivity * 4.0**-scheme.bits * (1 + 0.3 * rng.random())
                if scheme is not None and scheme.group_size == 128:
                    err *= 1.3
                options[cand] = CandidateCost(err, unit_storage_bits(scheme, shapes))
            prefix = f"model.layers.{layer}."
            units.append(UnitMeasurement(prefix + unit, [prefix + r for r in rel], params, options))
    return Measurement("HuggingFaceTB/SmolLM2-135M", "proxy", list(CANDS), units, {"seed": seed})


def random_measurement(rng: random.Random) -> Measurement:
    n_cand = rng.randint(2, 4)
    cands = rng.sample(CANDS, n_cand)
    units = []
    for i in range(rng.randint(3, 6)):
        present = [c for c in cands if rng.random() < 0.85] or cands[:1]
        options = {
            c: CandidateCost(rng.choice([rng.random(), float(rng.randint(0, 3))]), rng.randint(1, 40)) for c in present
        }
        units.append(UnitMeasurement(f"u{i}", [f"m.{i}.a", f"m.{i}.b"], rng.randint(1, 10), options))
    return Measurement("toy", "proxy", cands, units)


def brute_force(m: Measurement, budget: int, forced: dict[int, str]) -> float | None:
    """Least summed error over all assignments within the budget (None: infeasible)."""
    choices = [[forced[i]] if i in forced else list(u.options) for i, u in enumerate(m.units)]
    best = None
    for combo in itertools.product(*choices):
        cost = sum(u.options[c].bits for u, c in zip(m.units, combo, strict=True))
        err = sum(u.options[c].error for u, c in zip(m.units, combo, strict=True))
        if cost <= budget and (best is None or err < best):
            best = err
    return best


def test_optimal_against_brute_force_with_and_without_pins() -> None:
    rng = random.Random(1234)
    checked = infeasible = 0
    for _ in range(400):
        m = random_measurement(rng)
        pins: list[tuple[str, str]] = []
        forced: dict[int, str] = {}
        if rng.random() < 0.4:
            i = rng.randrange(len(m.units))
            cand = rng.choice(list(m.units[i].options))
            pins, forced = [(f"^m\\.{i}\\.b$", cand)], {i: cand}  # pin through a module name
        budget = rng.randint(1, sum(max(o.bits for o in u.options.values()) for u in m.units) + 3)
        target = budget / m.total_params
        budget = budget_bits(m, target_bits=target)
        expected = brute_force(m, budget, forced)
        if expected is None:
            infeasible += 1
            with pytest.raises(QuantkitError, match="smallest reachable size"):
                plan(m, target_bits=target, pins=pins)
            continue
        result = plan(m, target_bits=target, pins=pins)
        assert result.total_bits <= result.budget_bits == budget
        assert result.predicted_error == pytest.approx(expected, abs=1e-12)
        for i, cand in forced.items():
            assert result.units[i].candidate == cand and result.units[i].pinned
        checked += 1
    assert checked > 150 and infeasible > 10


def test_optimal_against_grid_dp_on_larger_instances() -> None:
    """10-40 groups, where bound pruning does real work: compare with a plain DP over every integer budget."""
    rng = random.Random(7)
    for _ in range(40):
        costs = [[rng.randint(0, 300) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(10, 40))]
        errors = [[rng.random() * rng.choice([1, 10, 100]) for _ in c] for c in costs]
        budget = rng.randint(sum(min(c) for c in costs), sum(max(c) for c in costs))
        best = np.zeros(budget + 1)  # best[w]: least error with total cost <= w
        for c, e in zip(costs, errors, strict=True):
            new = np.full(budget + 1, np.inf)
            for cj, ej in zip(c, e, strict=True):
                new[cj:] = np.minimum(new[cj:], best[: budget + 1 - cj] + ej) if cj <= budget else new[cj:]
            best = new
        picks = solve_mckp(costs, errors, budget)
        assert sum(c[j] for c, j in zip(costs, picks, strict=True)) <= budget
        assert sum(e[j] for e, j in zip(errors, picks, strict=True)) == pytest.approx(best[budget], rel=1e-12)


def test_solver_ties_prefer_cheaper_and_handles_degenerate_inputs() -> None:
    assert solve_mckp([[5, 3]], [[1.0, 1.0]], 10) == [1]  # equal error: the cheaper option
    assert solve_mckp([[5, 3], [2]], [[0.0, 1.0], [0.5]], 4) is None
    assert solve_mckp([], [], 0) == []
    assert solve_mckp([[10, 20], [10, 20]], [[2.0, 1.0], [3.0, 0.5]], 30) == [0, 1]


def test_budget_units_are_exact() -> None:
    m = smollm2_measurement(layers=1)
    params = m.total_params
    assert budget_bits(m, target_bits=4.1) == math.floor(41 * params / 10)
    assert budget_bits(m, max_size_mb=0.5) == 4_000_000  # 1 MB = 1e6 bytes
    assert budget_bits(m, target_bits=16, max_size_mb=0.5) == 4_000_000  # the tighter one
    with pytest.raises(QuantkitError, match="no budget"):
        budget_bits(m)
    with pytest.raises(QuantkitError, match="positive"):
        budget_bits(m, target_bits=-1.0)


def test_pins_hold_and_fused_units_get_one_candidate() -> None:
    m = smollm2_measurement(seed=3)
    pins = [(r"down_proj$", "int8"), (r"layers\.0\.", "fp16")]  # the later pin wins on layer 0
    result = plan(m, target_bits=5.5, pins=pins)
    assert result.total_bits <= result.budget_bits
    for unit in result.units:
        if unit.name.startswith("model.layers.0."):
            assert unit.candidate == "fp16" and unit.pinned
        elif unit.name.endswith("down_proj"):
            assert unit.candidate == "int8" and unit.pinned
    qkv = next(u for u in result.units if u.name == "model.layers.5.qkv")
    assert qkv.modules == [f"model.layers.5.{r}" for r in FUSED["qkv"]]  # one unit, one candidate


def test_parse_pin() -> None:
    assert parse_pin(r"layers\.(?P<x>0)=1\.=fp16") == (r"layers\.(?P<x>0)=1\.", "fp16")
    with pytest.raises(QuantkitError, match="<regex>=<candidate>"):
        parse_pin("down_proj")
    with pytest.raises(QuantkitError, match="unknown candidate"):
        parse_pin("down_proj=int9")


@pytest.mark.parametrize(
    ("pin", "message"),
    [
        (("down_proj", "int2-g32"), "was not measured"),
        (("nothing_here", "int8"), "matches no measured unit"),
        (("(unclosed", "int8"), "not a valid regular expression"),
    ],
)
def test_bad_pins(pin: tuple[str, str], message: str) -> None:
    with pytest.raises(QuantkitError, match=message):
        plan(smollm2_measurement(layers=2), target_bits=4.5, pins=[pin])


def test_impossible_budget_names_both_bounds() -> None:
    m = smollm2_measurement(layers=2)
    pins = [("qkv", "int8")]
    lo, hi = reachable_bits(m, pins)
    params = m.total_params
    with pytest.raises(QuantkitError) as info:
        plan(m, target_bits=3.0, pins=pins)
    text = str(info.value)
    assert f"{lo / params:.4f} bits/weight ({lo / 8e6:.3f} MB)" in text
    assert f"{hi / params:.4f} bits/weight ({hi / 8e6:.3f} MB)" in text
    assert "relax the pins" in text
    above = plan(m, target_bits=20.0, pins=pins)  # more than enough: least error everywhere
    assert above.total_bits == hi and all(u.candidate in ("fp16", "int8") for u in above.units)


# Partial plans the exact search keeps after any unit, measured: at most 313 (210 units) and 515 (120 fused units);
# 8,526 and 6,828 without the LP-bound pruning. The bound is ~4x the measured peak.
SEARCH_STATES_BOUND = 2_000


@pytest.mark.parametrize("fused", [False, True])
def test_speed_on_smollm2_sized_instance(fused: bool) -> None:
    m = smollm2_measurement(fused=fused, seed=7)
    assert len(m.units) == (120 if fused else 210)
    times, states = [], []
    for target in (3.6, 4.25, 4.5, 5.0, 6.0):
        start = time.perf_counter()
        result = plan(m, target_bits=target)
        times.append(time.perf_counter() - start)
        states.append(result.search_states)
        assert result.total_bits <= result.budget_bits
    print(
        f"\nplanning {len(m.units)} units x {len(CANDS)} candidates: at most {max(states)} partial plans kept, "
        f"max {max(times) * 1000:.1f} ms per plan"
    )
    assert 0 < max(states) <= SEARCH_STATES_BOUND


def test_frontier_is_monotone() -> None:
    m = smollm2_measurement(layers=4, seed=2)
    plans = plan_frontier(m)
    assert len(plans) >= 20
    bpw = [p.bits_per_weight for p in plans]
    errors = [p.predicted_error for p in plans]
    assert bpw == sorted(bpw)
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(errors))
    assert plans[-1].predicted_error == 0.0  # everything fp16 at the top
    assert plan_frontier(m, [0.5, 4.5])[0].target_bits == 4.5  # infeasible targets are skipped


def test_plot_writes_png(tmp_path: Path) -> None:
    from quantkit.mixed.plot import plot_frontier

    m = smollm2_measurement(layers=3)
    chosen = plan(m, target_bits=4.5)
    out = plot_frontier(m, chosen, tmp_path / "frontier.png", budgets=[3.6, 4.0, 4.5, 6.0, 10.0])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantkit.mixed.plot import plot_frontier

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    m = smollm2_measurement(layers=1)
    with pytest.raises(QuantkitError, match=r"pip install 'quantkit\[plot\]'"):
        plot_frontier(m, plan(m, target_bits=4.5), tmp_path / "x.png")
