"""Planner units of a mixture-of-experts block: the MLP stages (every expert's gate/up, each expert's down_proj,
the shared expert's) measured one by one, merged into one unit per layer.

vLLM loads all routed experts of a layer as one fused-MoE layer under one quantization method, so a plan gives
them one scheme (``ArchSpec.fused_groups``); the shared expert joins the unit because it shares the gate/up stage
(its inputs and Hessian) with the routed experts. Errors and bits are sums over the merged stages, as the
planner's objective is a sum over units.
"""

from __future__ import annotations

from quantkit.mixed.measurement import CandidateCost, UnitMeasurement
from quantkit.model.architectures import GATE_UP, ArchSpec
from quantkit.model.staged_moe import expert_stage


def is_expert_unit_stage(arch: ArchSpec, stage_name: str) -> bool:
    """Whether a stage's unit is merged into its layer's expert unit."""
    return arch.moe is not None and (stage_name == GATE_UP or expert_stage(stage_name) is not None)


def merge_expert_units(prefix: str, arch: ArchSpec, units: list[UnitMeasurement]) -> UnitMeasurement:
    """One unit for a layer's MLP stages ``units`` (every candidate's error and bits summed)."""
    candidates = [name for name in units[0].options if all(name in u.options for u in units)]
    options = {
        name: CandidateCost(
            error=sum(u.options[name].error for u in units), bits=sum(u.options[name].bits for u in units)
        )
        for name in candidates
    }
    return UnitMeasurement(
        name=f"{prefix}.{arch.mlp_path}.experts",
        modules=[module for u in units for module in u.modules],
        params=sum(u.params for u in units),
        options=options,
    )
