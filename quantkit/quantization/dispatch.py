"""Solver configs dispatched by type: a weight solver turns a stage's linears into integer weights, a transform
rewrites the float block before that (see :mod:`quantkit.quantization.methods` for how methods compose them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.quantization.awq_block import apply_awq_to_block
from quantkit.quantization.block_pass import BlockPass, BlockSchemes
from quantkit.quantization.methods import SolverConfig
from quantkit.quantization.records import AWQClipRecord, AWQScaleRecord, LayerRecord, RunRecord
from quantkit.quantization.solvers.awq import AWQConfig
from quantkit.quantization.solvers.gptq import GPTQConfig, gptq_solve, hessian_weighted_error
from quantkit.quantization.solvers.grid import RTNConfig, quantize_rtn

Solved = list[tuple[QuantizedWeight, LayerRecord]]
SolveFn = Callable[
    [SolverConfig, list[torch.Tensor], torch.Tensor | None, QuantScheme, torch.dtype, list[str], Path | None], Solved
]


@dataclass(frozen=True, slots=True)
class WeightSolver:
    """``solve(config, weights, hessian, scheme, storage, names, scratch)``: linears sharing one input (and one
    scheme) in, one quantized weight and record per linear out. ``needs_hessian``: whether ``hessian`` must be given;
    ``scratch``: a file the solver may park the Hessian in while it needs less of it (None: keep it in memory)."""

    needs_hessian: bool
    solve: SolveFn


def _solve_rtn(
    config: RTNConfig,
    weights: list[torch.Tensor],
    hessian: torch.Tensor | None,
    scheme: QuantScheme,
    storage: torch.dtype,
    names: list[str],
    scratch: Path | None = None,
) -> Solved:
    return [
        (quantize_rtn(w, scheme, scale_dtype=storage), LayerRecord(name, scheme.name, None, None))
        for w, name in zip(weights, names, strict=True)
    ]


def _solve_gptq(
    config: GPTQConfig,
    weights: list[torch.Tensor],
    hessian: torch.Tensor | None,
    scheme: QuantScheme,
    storage: torch.dtype,
    names: list[str],
    scratch: Path | None = None,
) -> Solved:
    """GPTQ on linears that share an input (one Hessian): rows are independent given H, so solving the
    row-stacked matrix once equals solving each linear alone, with one factorisation and one column sweep."""
    assert hessian is not None, "GPTQ needs the stage's Hessian"
    label = ", ".join(names)
    result = gptq_solve(  # the stacked copy is the solver's alone: it works in it and frees it early
        torch.cat(weights).float(),
        hessian,
        scheme,
        config,
        scale_dtype=storage,
        name=label,
        overwrite=True,
        hessian_scratch=scratch,
    )
    out, start = [], 0
    for w, name in zip(weights, names, strict=True):
        rows = slice(start, start + w.shape[0])
        start = rows.stop
        qw = result.weight
        part = QuantizedWeight(
            qweight=qw.qweight[rows].contiguous(),
            scale=qw.scale[rows].contiguous(),
            zero=None if qw.zero is None else qw.zero[rows].contiguous(),
            g_idx=qw.g_idx,
            scheme=scheme,
        )
        loss = hessian_weighted_error(w, part.dequantize(), hessian)
        out.append((part, LayerRecord(name, scheme.name, loss, result.damp, result.fell_back_to_rtn)))
    return out


WEIGHT_SOLVERS: dict[type, WeightSolver] = {
    RTNConfig: WeightSolver(needs_hessian=False, solve=_solve_rtn),  # type: ignore[arg-type]
    GPTQConfig: WeightSolver(needs_hessian=True, solve=_solve_gptq),  # type: ignore[arg-type]
}


def weight_solver(config: SolverConfig) -> WeightSolver:
    solver = WEIGHT_SOLVERS.get(type(config))
    if solver is None:
        raise QuantkitError(f"{type(config).__name__} is not a weight solver; end the list with RTN or GPTQ")
    return solver


@dataclass(frozen=True, slots=True)
class BlockTransform:
    """``apply(config, block, prefix, hidden, schemes, run)``: rewrites the float block in place on its
    calibration input ``hidden``, before its weights are quantized; returns what it decided, as records."""

    apply: Callable[..., list[RunRecord]]


def _apply_awq(
    config: AWQConfig, block: nn.Module, prefix: str, hidden: torch.Tensor, schemes: BlockSchemes, run: BlockPass
) -> list[RunRecord]:
    """AWQ's scales and clipping; its choices logged beside the solver records."""
    quantized = {name: s for name, s in schemes.items() if s is not None}
    assert run.runner is not None, "AWQ runs the block on its calibration input"
    report = apply_awq_to_block(block, run.arch, hidden, run.runner, quantized, config, scale_dtype=run.storage)
    records: list[RunRecord] = [
        AWQScaleRecord(f"{prefix}.{g.prev}", g.ratio, g.rtn_error, g.awq_error) for g in report.groups
    ]
    records += [AWQClipRecord(f"{prefix}.{c.linear}", c.mean_shrink) for c in report.clips]
    return records


TRANSFORMS: dict[type, BlockTransform] = {AWQConfig: BlockTransform(apply=_apply_awq)}


def split_solvers(solvers: Sequence[SolverConfig]) -> tuple[list[tuple[SolverConfig, BlockTransform]], SolverConfig]:
    """(the transforms with their configs, the final weight solver's config)."""
    *transforms, last = solvers
    return [(config, TRANSFORMS[type(config)]) for config in transforms], last
