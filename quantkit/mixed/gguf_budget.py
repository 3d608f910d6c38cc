"""``--format gguf:auto --target-bpw X``: each decoder linear's GGML type chosen under a bits-per-weight budget by
quantkit's exact planner (:func:`quantkit.mixed.mckp.solve_mckp`).

- The budget is llama.cpp's BPW: the bytes of every tensor of the file over its weights (metadata excluded),
  as llama.cpp prints it when it loads a model. The embedding, the output head and the norms keep the types
  llama.cpp's Q4_K_M gives them and are counted as fixed bytes; the decoder linears are the planner's units.
- Candidates: every GGML type whose block divides the linear's row (K-quants Q2_K..Q6_K where the row is a
  multiple of 256; Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0 on any row that is a multiple of 32).
- Cost: the tensor's bytes in that type. Error: the round-to-nearest error on that type's grid weighted by the
  Hessian of the linear's inputs in the float model, ``tr(dW H dW^T)`` (a measured sensitivity: GPTQ then
  lowers every candidate's error, the ranking is what the plan needs), or the plain squared error without
  calibration data (``--method rtn``).
The planner is exact: the least summed error whose bytes fit the budget. A larger budget never gives a larger
summed error (a solution within the smaller budget is within the larger one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.format.ggml.types import GGML_TYPES, fits
from quantkit.format.gguf_file import tensor_nbytes
from quantkit.mixed.mckp import solve_mckp

MIN_BPW, MAX_BPW = 2.0, 16.0  # outside these no model can be planned; the model's own range is checked after


@dataclass(slots=True)
class UnitTypes:
    hf_name: str
    params: int
    types: list[str]
    costs: list[int]  # bytes
    errors: list[float] = field(default_factory=list)


@dataclass(slots=True)
class TypeBudget:
    target_bpw: float
    bpw: float  # the plan's, over every tensor of the file
    fixed_bytes: int
    total_bytes: int
    params: int
    error: float  # summed measured error of the chosen types
    types: dict[str, str]  # HF name -> GGML type

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return {
            "target_bpw": self.target_bpw,
            "bpw": self.bpw,
            "total_bytes": self.total_bytes,
            "error": self.error,
            "linears_per_type": counts,
            "types": self.types,
        }


def candidate_types(in_features: int) -> list[str]:
    return [name for name, t in GGML_TYPES.items() if fits(t, in_features)]


def check_target(target_bpw: float) -> None:
    if not math.isfinite(target_bpw) or not MIN_BPW <= target_bpw <= MAX_BPW:
        raise QuantkitError(
            f"--target-bpw {target_bpw} is out of range; give bits per weight from {MIN_BPW} to {MAX_BPW}"
        )


def budget_range(units: list[UnitTypes], fixed_bytes: int, params: int) -> tuple[float, float]:
    lo = fixed_bytes + sum(min(u.costs) for u in units)
    hi = fixed_bytes + sum(max(u.costs) for u in units)
    return 8 * lo / params, 8 * hi / params


def choose(units: list[UnitTypes], fixed_bytes: int, params: int, target_bpw: float) -> TypeBudget:
    """The exact plan: per unit the type that minimises the summed error with every tensor's bytes within
    ``target_bpw`` bits per weight; QuantkitError naming the reachable range when none fits."""
    check_target(target_bpw)
    budget = math.floor(target_bpw * params / 8) - fixed_bytes
    picks = solve_mckp([u.costs for u in units], [u.errors for u in units], budget) if budget >= 0 else None
    if picks is None:
        lo, hi = budget_range(units, fixed_bytes, params)
        raise QuantkitError(
            f"--target-bpw {target_bpw} is out of range for this model: its GGUF tensors take {lo:.3f} to "
            f"{hi:.3f} bits per weight; give a target in that range"
        )
    chosen = {u.hf_name: u.types[i] for u, i in zip(units, picks, strict=True)}
    total = fixed_bytes + sum(u.costs[i] for u, i in zip(units, picks, strict=True))
    error = sum(u.errors[i] for u, i in zip(units, picks, strict=True))
    return TypeBudget(target_bpw, 8 * total / params, fixed_bytes, total, params, error, chosen)


def _error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor | None) -> float:
    delta = (weight.float() - dequantized).double()
    if hessian is None:
        return float(delta.square().sum())
    return float(((delta @ hessian.double()) * delta).sum())


def measure(weight: torch.Tensor, hessian: torch.Tensor | None, types: list[str]) -> list[float]:
    """Each candidate type's round-to-nearest error on ``weight`` (Hessian-weighted when ``hessian`` is given)."""
    from quantkit.quantization.solvers.ggml_solve import ggml_rtn

    return [_error(weight, ggml_rtn(weight.float(), t).dequantized, hessian) for t in types]


def plan_types(model: str, job: Any, target_bpw: float) -> TypeBudget:
    """The types of ``model``'s GGUF linears under ``target_bpw`` (``job``: a
    :class:`quantkit.quantization.gguf.driver.GGUFOutputConfig`; its calibration gives the Hessians)."""
    from quantkit.data.model_calibration import calibration_for_model
    from quantkit.model.resolve import arch_for_dir, load_tokenizer, resolve_model
    from quantkit.model.source_weights import SourceWeights
    from quantkit.quantization.gguf.mixes import mix_of
    from quantkit.quantization.gguf.plan import LINEAR, plan_gguf
    from quantkit.quantization.gguf.solve import GPTQ

    check_target(target_bpw)
    source = resolve_model(model)
    arch = arch_for_dir(source)
    with SourceWeights(source) as weights:
        plan = plan_gguf(weights, arch, mix_of("Q4_K_M"))
        params = sum(t.params for t in plan)
        fixed = sum(tensor_nbytes(t.type, t.shape) for t in plan if t.role != LINEAR)
        units = []
        for t in plan:
            if t.role == LINEAR:
                types = candidate_types(t.shape[-1])
                units.append(UnitTypes(t.hf_name, t.params, types, [tensor_nbytes(x, t.shape) for x in types]))
        lo, hi = budget_range(units, fixed, params)
        if not lo <= target_bpw <= hi:
            raise QuantkitError(
                f"--target-bpw {target_bpw} is out of range for this model: its GGUF tensors take {lo:.3f} to "
                f"{hi:.3f} bits per weight; give a target in that range"
            )
        calibration = None
        if job.solve.method == GPTQ:
            calibration = calibration_for_model(model, job.calibration, job.calibration_file, load_tokenizer(source))
        from quantkit.mixed.gguf_measure import measure_units

        measure_units(units, arch, weights, calibration, job)
    return choose(units, fixed, params, target_bpw)
