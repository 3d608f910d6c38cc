"""--target-bpw: the exact planner over GGML types keeps every tensor's bytes within the budget, and a larger budget
never gives a larger summed error; the measured errors fall with the bits of the type."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.format.gguf_file import tensor_nbytes
from quantkit.mixed.gguf_budget import UnitTypes, candidate_types, choose, measure


@pytest.fixture(scope="module")
def measured() -> tuple[list[UnitTypes], int, int]:
    """Six linears of a 256-wide model, measured with round-to-nearest on random weights and a correlated Hessian."""
    g = torch.Generator().manual_seed(0)
    units = []
    for i, (n, k) in enumerate([(64, 256), (32, 256), (96, 256), (32, 512), (64, 256), (16, 256)]):
        w = torch.randn(n, k, generator=g) * (1 + i / 3)
        x = torch.randn(64, k, generator=g) @ (torch.eye(k) + 0.1 * torch.randn(k, k, generator=g))
        h = 2 * x.T @ x / 64
        types = candidate_types(k)
        units.append(UnitTypes(f"l{i}.weight", n * k, types, [tensor_nbytes(t, (n, k)) for t in types]))
        units[-1].errors = measure(w, h, types)
    fixed = 4_000  # embedding and norms, kept as they are
    params = sum(u.params for u in units) + 3_000
    return units, fixed, params


def test_candidates_follow_the_row_length() -> None:
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"} <= set(candidate_types(512))
    assert not any(t.endswith("_K") for t in candidate_types(576)) and "Q8_0" in candidate_types(576)


def test_measured_error_falls_with_the_bits_of_k_quants(measured) -> None:
    units, _, _ = measured
    u = units[0]
    err = dict(zip(u.types, u.errors, strict=True))
    assert err["Q2_K"] > err["Q3_K"] > err["Q4_K"] > err["Q5_K"] > err["Q6_K"] > err["Q8_0"] > 0


def test_the_plan_stays_within_the_budget_and_more_bits_never_cost_error(measured) -> None:
    units, fixed, params = measured
    previous = None
    for target in [3.2, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0, 8.0, 8.6]:
        plan = choose(units, fixed, params, target)
        assert plan.bpw <= target
        assert plan.total_bytes == fixed + sum(tensor_nbytes(plan.types[u.hf_name], (u.params,)) for u in units)
        if previous is not None:
            assert plan.error <= previous.error
        previous = plan
    assert len(set(choose(units, fixed, params, 4.7).types.values())) >= 2  # a real mix between uniform points


def test_an_unreachable_target_names_the_range(measured) -> None:
    units, fixed, params = measured
    with pytest.raises(QuantkitError, match=r"--target-bpw 2.1 is out of range for this model: .* to .* bits"):
        choose(units, fixed, params, 2.1)
    with pytest.raises(QuantkitError, match=r"from 2\.0 to 16\.0"):
        choose(units, fixed, params, 40)
