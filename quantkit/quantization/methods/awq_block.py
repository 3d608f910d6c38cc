"""AWQ applied to one decoder block, in place: capture the block's stage inputs on its float calibration input,
search each scaling group's scales (:mod:`quantkit.quantization.solvers.awq`) against the inspected output, fold
them into the previous module, then clip the weights (:mod:`quantkit.quantization.solvers.awq_clip`); q/k
projections are never clipped. The float block computes the same function after folding.

Cost: the linear objective (the default) scores candidates through Gram matrices; the module objective runs the
module again for every candidate and grows linearly with ``search_samples`` (see
:mod:`quantkit.quantization.solvers.awq`; the timings are in docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import GATE_UP, ArchSpec, ScalingGroup
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.model.staged_moe import SHARED, expert_stage
from quantkit.quantization.solvers.awq import (
    AWQSettings,
    LossFn,
    Objective,
    _token_rows,
    awq_scale_search,
    fold_scales,
    gram_loss,
)
from quantkit.quantization.solvers.awq_clip import awq_clip_search, clip_weight
from quantkit.quantization.statistics import ActStat

_NO_CLIP = ("q_proj", "k_proj")  # clipping the query/key projections hurts attention


@dataclass(slots=True)
class GroupReport:
    prev: str
    linears: tuple[str, ...]
    ratio: float | None  # None: identity scales kept
    rtn_error: float  # inspected-output MSE, plain RTN
    awq_error: float  # inspected-output MSE, chosen scales
    inspected: str  # module whose output was scored ("" : linear outputs via Gram matrices)


@dataclass(slots=True)
class ClipReport:
    linear: str
    mean_shrink: float
    error_before: float
    error_after: float


@dataclass(slots=True)
class AWQBlockReport:
    groups: list[GroupReport] = field(default_factory=list)
    skipped: list[ScalingGroup] = field(default_factory=list)  # shapes do not allow folding (e.g. GQA v -> o)
    clips: list[ClipReport] = field(default_factory=list)
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------------ block driver


@dataclass(slots=True)
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(slots=True)
class _Captured:
    """Calibration inputs of one block: each stage's shared linear input, and calls of the inspected modules."""

    stage_inputs: dict[str, list[torch.Tensor]]  # first linear of a stage -> input batches
    calls: dict[str, list[_Call]]  # inspected module path -> its calls

    def rows(self, stage_head: str) -> torch.Tensor:
        return torch.cat([_token_rows(t) for t in self.stage_inputs[stage_head]])


def _captured_at(arch: ArchSpec, linear: str) -> str:
    """Where a linear's float input is captured: its stage's first linear; in an MoE block, the sparse MLP's own
    input for every MLP stage (an expert's linears see only its routed tokens in the forward pass, while AWQ, like
    the solve, scores every expert on every token: :func:`_input_rows`)."""
    stage = arch.stage_of(linear)
    if arch.moe is not None and (stage.name == GATE_UP or expert_stage(stage.name) is not None):
        return arch.mlp_path
    return stage.head


def _input_rows(
    block: nn.Module, arch: ArchSpec, captured: _Captured, group_scales: Mapping[str, torch.Tensor], linear: str
) -> torch.Tensor:
    """A linear's float input rows as the float block computed them, before any scales were folded. An expert's
    down_proj input is computed from the captured MLP input with the expert's gate/up as they are now: the MLP
    input divided by the scales folded into gate/up, and the result times those folded into the down_proj."""
    x = captured.rows(_captured_at(arch, linear))
    expert = expert_stage(arch.stage_of(linear).name)
    if arch.moe is None or expert is None or expert[0] == GATE_UP:
        return x
    key = expert[1]
    moe = get_module(block, arch.mlp_path)
    unit = getattr(moe, arch.moe.shared_expert or "") if key == SHARED else moe.expert_modules()[int(key)]
    gate = next(name for name in arch.linears if name.startswith(linear.rpartition(".")[0] + ".") and name != linear)
    if gate in group_scales:
        x = x / group_scales[gate]
    a = unit.act_fn(unit.gate_proj(x)) * unit.up_proj(x) if key == SHARED else unit.activation(x)
    return a * group_scales[linear] if linear in group_scales else a


def _output_width(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.out_features
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.ndim == 1 else None


def applicable_groups(block: nn.Module, arch: ArchSpec) -> tuple[list[ScalingGroup], list[ScalingGroup]]:
    """(groups whose shapes allow folding, skipped groups): e.g. v_proj -> o_proj is skipped under GQA."""
    ok, skipped = [], []
    for group in arch.awq_groups:
        width = _output_width(get_module(block, group.prev))
        # a group's modules are Linears or hold a [N, K] weight (an MoE router, scaled with the experts it routes to)
        fits = width is not None and all(get_module(block, name).weight.shape[1] == width for name in group.linears)
        (ok if fits else skipped).append(group)
    return ok, skipped


def _inspected_module(group: ScalingGroup, earlier_balanced: set[str], objective: Objective) -> str:
    """The linears' common parent for a multi-linear group under the module objective, else "" (Gram-based)."""
    if objective != "module" or len(group.linears) < 2:
        return ""
    parts = [name.split(".")[:-1] for name in group.linears]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    parent = ".".join(common)
    # The module is re-run on inputs captured before any folding: it must not contain an earlier group's linears.
    if not parent or any(name.startswith(parent + ".") for name in earlier_balanced):
        return ""
    return parent


def _capture(
    block: nn.Module, hidden: torch.Tensor, runner: BlockRunner, heads: list[str], inspected: list[str]
) -> _Captured:
    """One float pass of ``block`` over ``hidden`` recording the stage inputs and the inspected modules' calls."""
    captured = _Captured({h: [] for h in heads}, {m: [] for m in inspected})
    handles = []
    for head in heads:

        def grab(_module: nn.Module, args: tuple[Any, ...], head: str = head) -> None:
            captured.stage_inputs[head].append(args[0].detach())

        handles.append(get_module(block, head).register_forward_pre_hook(grab))
    for path in inspected:

        def grab_call(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
            captured.calls[path].append(_Call(args, dict(kwargs)))

        handles.append(get_module(block, path).register_forward_pre_hook(grab_call, with_kwargs=True))
    try:
        for start in range(0, hidden.shape[0], runner.batch_size):
            runner(block, hidden[start : start + runner.batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _first_output(out: Any) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float()


def module_loss(module: nn.Module, linears: Sequence[nn.Linear], calls: Sequence[_Call]) -> LossFn:
    """MSE of ``module``'s output on ``calls`` when ``linears`` hold the candidate weights (restored afterwards)."""
    originals = [lin.weight.detach().clone() for lin in linears]
    reference = [_first_output(module(*c.args, **c.kwargs)) for c in calls]
    numel = sum(r.numel() for r in reference)

    def loss(candidates: Sequence[torch.Tensor]) -> float:
        try:
            for lin, cand in zip(linears, candidates, strict=True):
                lin.weight.copy_(cand)
            total = 0.0
            for call, ref in zip(calls, reference, strict=True):
                total += float((_first_output(module(*call.args, **call.kwargs)) - ref).square().sum())
        finally:
            for lin, orig in zip(linears, originals, strict=True):
                lin.weight.copy_(orig)
        return total / numel

    return loss


def _group_loss(block: nn.Module, group: ScalingGroup, inspected: str, x: torch.Tensor, captured: _Captured) -> LossFn:
    linears = [get_module(block, name) for name in group.linears]
    if inspected:
        return module_loss(get_module(block, inspected), linears, captured.calls[inspected])
    return gram_loss([lin.weight for lin in linears], x.T @ x, x.shape[0])


@torch.no_grad()
def apply_awq_to_block(
    block: nn.Module,
    arch: ArchSpec,
    hidden: torch.Tensor,
    runner: BlockRunner,
    schemes: Mapping[str, QuantScheme],
    config: AWQSettings,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> AWQBlockReport:
    """AWQ on one decoder block, in place: scales folded into norms / previous linears / balanced linears, then
    (``config.clip``) weights clamped. ``hidden`` [n, T, H]: the block's float calibration input; ``schemes``: the
    scheme of each linear (path relative to the block; a linear without one is left unquantized and unclipped).
    """
    t0 = time.perf_counter()
    report = AWQBlockReport()
    if config.search_samples is not None:
        hidden = hidden[: config.search_samples]
    groups, report.skipped = applicable_groups(block, arch)
    balanced: set[str] = set()
    inspected: dict[ScalingGroup, str] = {}
    for group in groups:
        inspected[group] = _inspected_module(group, balanced, config.objective)
        balanced.update(group.linears)
    heads = sorted({_captured_at(arch, name) for name in arch.linears})
    captured = _capture(block, hidden, runner, heads, sorted({m for m in inspected.values() if m}))
    group_scales: dict[str, torch.Tensor] = {}  # balanced linear -> the scales its input was divided by

    def rows(name: str) -> torch.Tensor:
        return _input_rows(block, arch, captured, group_scales, name)

    for group in groups:
        x = rows(group.linears[0])
        stat = ActStat.zeros(x.shape[1], device=x.device)
        stat.update(x)
        linears = [get_module(block, name) for name in group.linears]
        loss_fn = _group_loss(block, group, inspected[group], x, captured)
        result = awq_scale_search(
            [lin.weight for lin in linears],
            [schemes.get(name) for name in group.linears],
            stat.mean(),
            loss_fn,
            config,
            scale_dtype=scale_dtype,
        )
        if result.ratio is not None:
            fold_scales(get_module(block, group.prev), linears, result.scales, arch.norm_offset)
            group_scales.update(dict.fromkeys(group.linears, result.scales))
        report.groups.append(
            GroupReport(group.prev, group.linears, result.ratio, result.rtn_error, result.error, inspected[group])
        )

    if config.clip:
        for name in arch.linears:
            if name.rsplit(".", 1)[-1] in _NO_CLIP or name not in schemes:
                continue
            x = rows(name)
            if name in group_scales:
                x = x / group_scales[name]
            linear = get_module(block, name)
            clip = awq_clip_search(linear.weight, x, schemes[name], config, scale_dtype=scale_dtype)
            linear.weight.copy_(clip_weight(linear.weight, clip.max_val, schemes[name]))
            report.clips.append(ClipReport(name, clip.mean_shrink, clip.error_before, clip.error_after))
    report.seconds = time.perf_counter() - t0
    return report
