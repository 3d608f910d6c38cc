"""Quantizing one decoder block: transforms of the float block (AWQ), then each stage's linears solved on the
inputs computed with every earlier stage already quantized, then the block's output for the next block."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.memory import release_freed_memory
from quantkit.model.architectures import DOWN, GATE_UP
from quantkit.model.blocks import get_module
from quantkit.quantization.block_loop import stage_hessians
from quantkit.quantization.block_pass import BlockPass, BlockSchemes
from quantkit.quantization.dispatch import split_solvers, weight_solver
from quantkit.quantization.float_targets import FloatPath, StageMoments, float_target
from quantkit.quantization.records import RunRecord, TuneRecord
from quantkit.quantization.solvers.gptq import GPTQConfig
from quantkit.quantization.solvers.tune import tune_block
from quantkit.quantization.staged_block import StagedBlock


@dataclass(slots=True)
class QuantizedBlock:
    weights: dict[str, QuantizedWeight]  # by linear path relative to the block
    output: torch.Tensor | None  # the next block's input (None when data-free)
    records: list[RunRecord] = field(default_factory=list)
    reference_output: torch.Tensor | None = None  # with tuning: the float model's output, the next block's target


def write_back_dequantized(linear: nn.Linear, weight: QuantizedWeight) -> None:
    """The float block now computes with the quantized weight (later stages see its output)."""
    linear.weight.data = weight.dequantize(torch.float32)


def quantize_block(
    block: nn.Module,
    prefix: str,
    hidden: torch.Tensor | None,
    schemes: BlockSchemes,
    run: BlockPass,
    reference: torch.Tensor | None = None,
) -> QuantizedBlock:
    """Quantize one block in place: its linears end up holding their dequantized weights, except on a run without
    tuning: there the attention linears end up empty once h2 is complete, and with a spill file gate and up too
    (once only down_proj runs again).

    ``hidden`` [n, T, H]: the block's calibration input (None for a data-free run); the output is written over
    it (one activation buffer less): pass a clone to keep the input. ``reference``: with tuning, the float
    model's own input to this block (its activations with no block quantized; None: ``hidden``). Tuning fits the
    quantized block, fed ``hidden``, to the float block's output on ``reference`` (AutoRound's targets), so each
    block also makes up for the error of the blocks before it.
    """
    if run.runner is None or hidden is None:
        return _quantize_data_free(block, prefix, schemes, run)
    transforms, last = split_solvers(run.solvers)
    solver = weight_solver(last)
    out = QuantizedBlock({}, None)
    tuning = run.tune is not None and run.tune.steps > 0
    float_input = hidden if reference is None else reference
    # with float targets (and no transform that changes the float block) the float path computes the float
    # output on the way; else it is computed here, before anything changes the block
    float_targets = isinstance(last, GPTQConfig) and last.float_targets
    float_path_output = float_targets and not transforms
    if (tuning or run.keep_reference) and not float_path_output:  # the float output: tuning reproduces it
        out.reference_output = run.runner.run(block, float_input)
    if tuning:  # the solve overwrites ``hidden``
        inputs = hidden.clone()
    for config, transform in transforms:
        out.records += transform.apply(config, block, prefix, hidden, schemes, run)
    # a float copy, before any linear is quantized
    float_path = FloatPath(block, run.arch, run.runner, float_input) if float_targets else None
    staged = StagedBlock(block, run.arch, run.runner, hidden, spill=run.spill)
    for stage, hessian, moments in stage_hessians(staged, with_hessian=solver.needs_hessian, float_path=float_path):
        if not tuning and (stage.name == GATE_UP or (stage.name == DOWN and staged.output_reads_spill)):
            # h2 is complete, so no later step runs the attention linears; with every down_proj input spilled,
            # only down_proj runs again (the output is h2 + down(spilled inputs))
            _drop_dense(block, out.weights)
        for names, scheme in _same_scheme_runs(stage.linears, schemes):
            _solve_run(block, prefix, names, scheme, hessian, run, out, moments)
        del hessian, moments
    if float_path is not None and float_path_output and (tuning or run.keep_reference):
        out.reference_output = float_path.output()
    del float_path
    release_freed_memory()
    out.output = staged.output()
    if tuning:
        assert out.reference_output is not None
        _tune(block, prefix, inputs, out.reference_output, out, run)
    return out


def _solve_run(
    block: nn.Module,
    prefix: str,
    names: list[str],
    scheme: QuantScheme,
    hessian: torch.Tensor | None,
    run: BlockPass,
    out: QuantizedBlock,
    moments: StageMoments | None = None,
) -> None:
    """Solve linears that share an input and a scheme; each then computes with its dequantized weight (its float
    weight is freed as soon as the solver is done with it). ``moments``: the solver then fits the float targets
    (:mod:`quantkit.quantization.float_targets`)."""
    _, config = split_solvers(run.solvers)
    linears = [get_module(block, name) for name in names]
    weights = [linear.weight.data for linear in linears]
    if moments is not None and hessian is not None and isinstance(config, GPTQConfig):
        weights = [
            float_target(w, hessian, moments.shift(name, w, hessian), config.damp)
            for name, w in zip(names, weights, strict=True)
        ]
    fulls = [f"{prefix}.{name}" for name in names]
    solved = weight_solver(config).solve(config, weights, hessian, scheme, run.storage, fulls, run.hessian_scratch)
    del weights
    for name, linear, (weight, record) in zip(names, linears, solved, strict=True):
        write_back_dequantized(linear, weight)
        out.weights[name] = weight
        out.records.append(record)


def _drop_dense(block: nn.Module, quantized: dict[str, QuantizedWeight]) -> None:
    """Free the dequantized float weights of linears already quantized (their integer weights are kept): at a 1B
    model's down_proj stage that is 176 MB no later step reads."""
    for name in quantized:
        linear = get_module(block, name)
        linear.weight.data = linear.weight.data.new_empty(0)


def _tune(
    block: nn.Module, prefix: str, inputs: torch.Tensor, targets: torch.Tensor, out: QuantizedBlock, run: BlockPass
) -> None:
    """Tune the solved block's rounding and scales to its float output; the block, its weights and its output
    (the next block's input) become the tuned ones when they lower the error."""
    assert run.tune is not None and run.runner is not None
    weights, result = tune_block(
        block,
        run.runner,
        inputs,
        targets,
        out.weights,
        run.tune,
        run.storage,
        start_outputs=out.output,
        keep_outputs=True,
    )
    for name, weight in weights.items():
        write_back_dequantized(get_module(block, name), weight)
    out.weights, out.output = weights, result.outputs
    assert result.loss_before is not None and result.loss_after is not None
    out.records.append(TuneRecord(prefix, result.loss_before, result.loss_after, result.steps, result.kept))


def _quantize_data_free(block: nn.Module, prefix: str, schemes: BlockSchemes, run: BlockPass) -> QuantizedBlock:
    """Each linear straight from its stored weight: no calibration, no forward pass."""
    transforms, last = split_solvers(run.solvers)
    solver = weight_solver(last)
    assert not transforms and not solver.needs_hessian, "only round-to-nearest alone runs without data"
    out = QuantizedBlock({}, None)
    for name, scheme in schemes.items():
        if scheme is not None:
            stored = get_module(block, name).weight.data
            ((weight, record),) = solver.solve(last, [stored], None, scheme, run.storage, [f"{prefix}.{name}"])
            out.weights[name] = weight
            out.records.append(record)
    return out


def _same_scheme_runs(linears: tuple[str, ...], schemes: BlockSchemes) -> list[tuple[list[str], QuantScheme]]:
    """The stage's quantized linears grouped by scheme (a fused group always forms one run)."""
    runs: dict[QuantScheme, list[str]] = {}
    for name in linears:
        scheme = schemes.get(name)
        if scheme is not None:
            runs.setdefault(scheme, []).append(name)
    return [(names, scheme) for scheme, names in runs.items()]
