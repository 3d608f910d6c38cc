"""SmoothQuant applied to one decoder block, in place: one float pass over the block's calibration input records
each scaling group's input maxima per channel and the float output; the alpha (one for the whole block) is searched
by running the block with the smoothed weights quantized on the job's grid and every quantized linear's input
quantized as the serving kernel does (:func:`quantkit.format.input_quant.fake_quantize_input`), scored by the
squared error of the block output; the chosen factors are then folded into the float block, which computes the
same function after. The math is :mod:`quantkit.quantization.solvers.smoothquant`.

The scaling groups are AWQ's (:func:`quantkit.quantization.methods.awq_block.applicable_groups`): one home for
which module feeds which linears, and which of them a model's shapes let fold (under GQA, v_proj -> o_proj does not).
In a mixture-of-experts block the post-attention norm's group holds every reader of the norm: the router (kept in
float, its columns scaled all the same, so routing is unchanged), every routed expert's gate/up, the shared expert's
gate/up and its sigmoid gate; each expert's up_proj -> down_proj is a group of its own where the activation lets the
factors through (not gpt_oss's clamped SwiGLU). The factors follow the linears that are quantized: float linears
take the scales but not a say in them. Inputs are read as the MoE calibration reads them (:func:`_tap`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from quantkit.format.input_quant import fake_quantize_input, static_input_scale
from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import DOWN, ArchSpec, ScalingGroup
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.model.staged_moe import ALL, SHARED, expert_stage
from quantkit.quantization.methods.awq_block import applicable_groups
from quantkit.quantization.solvers.awq import fold_scales
from quantkit.quantization.solvers.smoothquant import (
    AlphaSearch,
    alpha_grid,
    channel_absmax,
    fake_quantize_weights,
    search_alpha,
    smoothing_scales,
    weight_absmax,
)


class SmoothSettings(Protocol):
    """The options the block driver reads (``quantization/methods/smoothquant.py`` holds them, with defaults)."""

    alpha: float | None  # None: searched
    grid: int  # alphas i / grid, i = 0 .. grid
    search_samples: int | None  # the search runs the block on the first N windows (None: all)


@dataclass(slots=True)
class SmoothReport:
    alpha: float | None  # None: left unsmoothed (no alpha beat it)
    search: AlphaSearch | None  # None: a fixed alpha, nothing searched
    groups: list[ScalingGroup] = field(default_factory=list)  # the groups smoothed
    skipped: list[ScalingGroup] = field(default_factory=list)  # shapes do not allow folding


@dataclass(slots=True)
class _Group:
    """A scaling group with what its factors are computed from: the float block's input and weight maxima."""

    group: ScalingGroup
    x_absmax: torch.Tensor  # [K]
    w_absmax: torch.Tensor  # [K]

    def scales(self, alpha: float) -> torch.Tensor:
        return smoothing_scales(self.x_absmax, self.w_absmax, alpha)


@dataclass(frozen=True, slots=True)
class _Tap:
    """Where the float pass reads a group's input: the module whose calls see it, and how the group's input follows
    from such a call's input (None: it is that input)."""

    module: str
    derive: Callable[[torch.Tensor], torch.Tensor] | None = None


def _tap(block: nn.Module, arch: ArchSpec, group: ScalingGroup, moe_calibration: str) -> _Tap:
    """A group's input is its first linear's. A sparse MLP's forward runs each routed expert on its routed tokens
    only, so there the statistics follow the MoE calibration instead: the post-attention norm's group reads the MoE's
    own input (every token: the router and the shared expert see them all); a routed expert's down_proj, under
    ``all``, the expert's activation of every token (under ``routed``: its own calls, the tokens routed to it)."""
    if arch.moe is None:
        return _Tap(group.linears[0])
    if group.prev == arch.norms[1]:
        return _Tap(arch.mlp_path)
    expert = expert_stage(arch.stage_of(group.linears[0]).name)
    if expert is None or expert[0] != DOWN or expert[1] == SHARED or moe_calibration != ALL:
        return _Tap(group.linears[0])
    return _Tap(arch.mlp_path, get_module(block, arch.mlp_path).expert_modules()[int(expert[1])].activation)


def _float_pass(
    block: nn.Module, taps: Sequence[_Tap], hidden: torch.Tensor, runner: BlockRunner, keep: int
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """The float block over ``hidden``: each group's input maximum per channel (over every window, as SmoothQuant
    calibrates; None for a routed expert no token reached), and the output of the first ``keep`` windows (the
    search's reference)."""
    maxima: list[torch.Tensor | None] = [None] * len(taps)
    handles = []
    for index, tap in enumerate(taps):

        def grab(_module: nn.Module, args: tuple[Any, ...], index: int = index, tap: _Tap = tap) -> None:
            seen = channel_absmax(args[0] if tap.derive is None else tap.derive(args[0]))
            known = maxima[index]
            maxima[index] = seen if known is None else torch.maximum(known, seen)

        handles.append(get_module(block, tap.module).register_forward_pre_hook(grab))
    kept = []
    try:
        for start, batch in _batches(hidden, runner):
            out = runner(block, batch)
            if start < keep:
                kept.append(out[: keep - start].float())
    finally:
        for handle in handles:
            handle.remove()
    reference = torch.cat(kept) if kept else hidden.new_empty(0, *hidden.shape[1:], dtype=torch.float32)
    return maxima, reference


def _quantized(group: ScalingGroup, arch: ArchSpec) -> list[str]:
    """The group's linears that are quantized (a router, kept in float, is scaled but does not set the factors)."""
    kept = [name for name in group.linears if name not in arch.float_linears]
    return kept or list(group.linears)


def _batches(hidden: torch.Tensor, runner: BlockRunner) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, mini-batch) over ``hidden`` in the runner's batch size."""
    for start in range(0, hidden.shape[0], runner.batch_size):
        yield start, hidden[start : start + runner.batch_size]


def _same_scheme_runs(arch: ArchSpec, schemes: Mapping[str, QuantScheme]) -> list[tuple[list[str], QuantScheme]]:
    """Each stage's quantized linears grouped by scheme: the linears a solver quantizes together."""
    runs = []
    for stage in arch.stages:
        by_scheme: dict[QuantScheme, list[str]] = {}
        for name in stage.linears:
            if name in schemes:
                by_scheme.setdefault(schemes[name], []).append(name)
        runs += [(names, scheme) for scheme, names in by_scheme.items()]
    return runs


@contextmanager
def _quantized_inputs(block: nn.Module, schemes: Mapping[str, QuantScheme], storage: torch.dtype) -> Iterator[None]:
    """While open, each quantized linear with an input scheme sees its input quantized and dequantized. A static
    scale (FP8's input scale, NVFP4's global scale) is the min-max one of the call's own input: the search sees
    the range the calibrated scale will cover."""
    handles = []
    for name, scheme in schemes.items():
        acts = scheme.activations
        if acts is None:
            continue

        def quantize_input(_module: nn.Module, args: tuple[Any, ...], acts: Any = acts) -> tuple[Any, ...]:
            x = args[0]
            static = static_input_scale(float(x.abs().amax()), acts, storage) if acts.static_scale else None
            return (fake_quantize_input(x, acts, static), *args[1:])

        handles.append(get_module(block, name).register_forward_pre_hook(quantize_input))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Trial:
    """Scores an alpha on the block itself: the factors folded, the weights quantized, the inputs quantized; the
    touched parameters are restored after every trial."""

    def __init__(
        self,
        block: nn.Module,
        arch: ArchSpec,
        groups: list[_Group],
        schemes: Mapping[str, QuantScheme],
        hidden: torch.Tensor,
        reference: torch.Tensor,
        runner: BlockRunner,
        storage: torch.dtype,
    ) -> None:
        self.block, self.groups, self.schemes = block, groups, schemes
        self.hidden, self.reference, self.runner, self.storage = hidden, reference, runner, storage
        self.runs = _same_scheme_runs(arch, schemes)
        self.norm_offset = arch.norm_offset
        touched = {g.group.prev for g in groups} | {n for g in groups for n in g.group.linears} | set(schemes)
        self.saved = {
            (name, key): p.detach().clone()
            for name in sorted(touched)
            for key, p in get_module(block, name).named_parameters(recurse=False)
        }

    def restore(self) -> None:
        for (name, key), value in self.saved.items():
            getattr(get_module(self.block, name), key).copy_(value)

    def __call__(self, alpha: float | None) -> float:
        """Mean squared error of the block output against the float block's, smoothed with ``alpha`` (None: not)."""
        try:
            if alpha is not None:
                fold_all(self.block, self.groups, alpha, self.norm_offset)
            for names, scheme in self.runs:
                linears = [get_module(self.block, name) for name in names]
                dense = fake_quantize_weights([lin.weight for lin in linears], scheme, self.storage)
                for linear, weight in zip(linears, dense, strict=True):
                    linear.weight.copy_(weight)
            total, count = 0.0, 0
            with _quantized_inputs(self.block, self.schemes, self.storage):
                for start, batch in _batches(self.hidden, self.runner):
                    expected = self.reference[start : start + batch.shape[0]]
                    total += float((self.runner(self.block, batch).float() - expected).square().sum())
                    count += expected.numel()
            return total / count
        finally:
            self.restore()


def fold_all(block: nn.Module, groups: Sequence[_Group], alpha: float, norm_offset: float = 0.0) -> None:
    """Fold every group's factors at ``alpha`` into ``block``: the float function is unchanged. The factors come
    from the float block's maxima, so folding one group first does not change another's. ``norm_offset``: the
    architecture's (Gemma's norms multiply by 1 + weight)."""
    for g in groups:
        linears = [get_module(block, n) for n in g.group.linears]
        fold_scales(get_module(block, g.group.prev), linears, g.scales(alpha), norm_offset)


@torch.no_grad()
def smooth_block(
    block: nn.Module,
    arch: ArchSpec,
    hidden: torch.Tensor,
    runner: BlockRunner,
    schemes: Mapping[str, QuantScheme],
    config: SmoothSettings,
    storage: torch.dtype,
    moe_calibration: str = ALL,
) -> SmoothReport:
    """SmoothQuant on one block, in place. ``hidden`` [n, T, H]: the block's float calibration input; ``schemes``:
    the scheme of each quantized linear (path relative to the block); ``storage``: the dtype scales are stored in;
    ``moe_calibration``: which tokens a routed expert's statistics are read on (``--moe-calibration``)."""
    applicable, skipped = applicable_groups(block, arch)
    searched = config.alpha is None
    keep = 0 if not searched else hidden.shape[0] if config.search_samples is None else config.search_samples
    taps = [_tap(block, arch, group, moe_calibration) for group in applicable]
    maxima, reference = _float_pass(block, taps, hidden, runner, keep)
    unread = [group for group, x_max in zip(applicable, maxima, strict=True) if x_max is None]
    assert arch.moe is not None or not unread, "every scaling group's input is read in a pass of its block"
    skipped += unread  # routed calibration: an expert no token reached has no statistics to smooth by
    groups = [
        _Group(group, x_max, weight_absmax([get_module(block, n).weight for n in _quantized(group, arch)]))
        for group, x_max in zip(applicable, maxima, strict=True)
        if x_max is not None
    ]
    applicable = [g.group for g in groups]
    report = SmoothReport(alpha=config.alpha, search=None, groups=list(applicable), skipped=skipped)
    if searched:
        trial = _Trial(block, arch, groups, schemes, hidden[: reference.shape[0]], reference, runner, storage)
        report.search = search_alpha(alpha_grid(config.grid), trial)
        report.alpha = report.search.alpha
    if report.alpha is None:
        report.groups = []
    else:
        fold_all(block, groups, report.alpha, arch.norm_offset)
    return report
