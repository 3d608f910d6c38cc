"""Quantizing one decoder block: the transforms of the float block, then each stage's linears solved on inputs
computed with every earlier stage already quantized, then the block's output for the next block, then tuning.
Which algorithm runs where is the job's (:class:`~quantkit.quantization.methods.composition.JobSteps`, in
:class:`~quantkit.quantization.methods.registry.Role` order); nothing here names one."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from quantkit.format.scheme import QuantScheme
from quantkit.memory import release_freed_memory
from quantkit.model.blocks import get_module
from quantkit.model.kv_attention import OBSERVE, attention_implementation, kv_scales, take_kv_absmax
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.block_loop import stage_hessians
from quantkit.quantization.block_work import BlockRun, QuantizedBlock
from quantkit.quantization.input_ranges import InputRangeObserver, merge_ranges
from quantkit.quantization.methods.hooks import BlockSchemes, BlockWork, SolveJob
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.methods.registry import Role


def quantize_block(
    block: nn.Module,
    prefix: str,
    hidden: torch.Tensor | None,
    schemes: BlockSchemes,
    run: BlockRun,
    reference: torch.Tensor | None = None,
) -> QuantizedBlock:
    """Quantize one block in place; its linears end up holding their dequantized weights (unless the memory
    strategy freed them once no later step reads them).

    ``hidden`` [n, T, H]: the block's calibration input (None for a data-free run); the output is written over
    it: pass a clone to keep the input. ``reference``: the float model's own input to this block when the run
    carries the float path (None: ``hidden``); tuning fits the block to the float block's output on it.
    """
    if run.runner is None or hidden is None:
        return _quantize_data_free(block, prefix, schemes, run)
    steps = run.steps
    float_input = hidden if reference is None else reference
    work = BlockWork(block, prefix, schemes, run.arch, run.storage, run.runner, hidden, float_input)
    work.moe_calibration = run.moe_calibration
    transforms, targets = steps.with_role(Role.TRANSFORM), steps.with_role(Role.TARGET)
    # the float block's output, taken before a transform changes the block, unless a target's companion runs the
    # untransformed float block stage by stage and computes it on the way
    companion_output = bool(targets) and not transforms
    if steps.keeps_float_path and not companion_output:
        work.reference_output = run.runner.run(block, work.float_input)
    if steps.any_cap("reads_solved_block"):
        work.kept_input = hidden.clone()  # the solve overwrites ``hidden``
    for step in transforms:
        work.records += _transform(step, work, run)
    companions = [step.hooks.companion(step.config, work) for step in targets]
    staged = StagedBlock(
        block, run.arch, run.runner, hidden, spill=run.memory.spill, moe_calibration=run.moe_calibration
    )
    first_row = 0 if run.ranks is None else run.ranks.rows.start * hidden.shape[1]  # this rank's first token
    observer = InputRangeObserver(run.sample_every, first_row) if _static_inputs(schemes) else None
    attention = get_module(block, run.arch.attn_path)
    with attention_implementation(attention, OBSERVE) if run.kv_cache else nullcontext():
        _solve_stages(work, run, staged, companions, observer)
    extra = {}
    if run.kv_cache is not None:
        absmax = take_kv_absmax(attention)
        if run.ranks is not None:  # the largest magnitude over every rank's windows: exact in any order
            absmax = run.ranks.all_max_(absmax.contiguous())
        scales = kv_scales(absmax, run.kv_cache.strategy == "attn_head", run.storage)
        extra = {f"{run.arch.attn_path}.{name}": scale for name, scale in scales.items()}
    if staged.experts is not None:
        if run.ranks is not None:  # every rank's routing: the records count the tokens of all windows
            staged.experts.counts = run.ranks.sum_counts(staged.experts.counts)
        _record_routing(work.records, prefix, staged)
    if companion_output:
        work.reference_output = companions[0].float_output()
    del companions
    release_freed_memory()
    work.output = staged.output()
    for step in steps.with_role(Role.TUNE):
        work.records += _tune(step, work, run)
    return QuantizedBlock(work.weights, work.output, work.records, work.reference_output, extra)


def _transform(step: Any, work: BlockWork, run: BlockRun) -> list[Any]:
    """One transform of the float block. On several processes rank 0 runs it on the windows it reads, gathered
    from every rank (so it computes what one process computes), and hands the transformed block to the others;
    its records are rank 0's (the only ones written)."""
    if run.ranks is None:
        return step.hooks.transform(step.config, work)
    gathered = run.ranks.gather_first(work.hidden, step.hooks.transform_windows(step.config))
    records = [] if gathered is None else step.hooks.transform(step.config, replace(work, hidden=gathered))
    del gathered
    run.ranks.share_block(work.block)
    return records


def _tune(step: Any, work: BlockWork, run: BlockRun) -> list[Any]:
    """Tuning of the solved block. On several processes rank 0 tunes it on every window (the inputs, float outputs
    and solved outputs gathered from all ranks, so it computes what one process computes), then broadcasts the
    tuned weights and hands each rank its rows of the tuned output."""
    if run.ranks is None:
        return step.hooks.tune(step.config, work)
    ranks = run.ranks
    assert work.kept_input is not None and work.reference_output is not None and work.output is not None
    device = work.output.device
    kept, reference = ranks.gather_rows(work.kept_input), ranks.gather_rows(work.reference_output)
    output = ranks.gather_rows(work.output)
    records, weights = [], None
    if ranks.context.is_main:
        whole = replace(work, kept_input=kept, reference_output=reference, output=output)
        records = step.hooks.tune(step.config, whole)  # writes the tuned weights back into the (shared) block
        weights, output = whole.weights, whole.output
    del kept, reference
    work.weights = ranks.share_weights(weights, device)
    if not ranks.context.is_main:
        for name, weight in work.weights.items():
            work.write_back(name, weight)
    work.output = ranks.scatter_rows(output, device)
    return records


def _static_inputs(schemes: BlockSchemes) -> bool:
    return any(s is not None and s.activations is not None and s.activations.static_scale for s in schemes.values())


def _solve_stages(
    work: BlockWork, run: BlockRun, staged: StagedBlock, companions: list[Any], observer: InputRangeObserver | None
) -> None:
    """Each stage's linears, grouped by scheme, solved on the stage's Hessian (and the targets' stage data); with
    an ``observer``, the static input scales of the stage's linears from the range of their inputs."""
    solver = run.steps.solver
    targets = run.steps.with_role(Role.TARGET)
    keep_dense = run.steps.any_cap("reads_solved_block")
    with_hessian = solver.algorithm.caps.needs_hessian
    watching = [*companions, observer] if observer is not None else companions
    moe = run.arch.moe is not None
    runs = {stage.name: _solve_runs(stage.linears, work.schemes, work.block, moe) for stage in staged.stages}
    # several processes: which rank solves each run (the stage's Hessian goes to those ranks alone)
    owners = {name: _owners(run, work.block, stage_runs) for name, stage_runs in runs.items()}
    share = None if run.ranks is None else run.ranks.batch_share(lambda stage: set(owners[stage.name] or ()))
    stages = stage_hessians(staged, with_hessian=with_hessian, companions=watching, share=share)
    for stage, hessian, stage_data in stages:
        input_range = stage_data.pop() if observer is not None else None
        if input_range is not None and run.ranks is not None:  # every rank's range and row sample, in row order
            input_range = merge_ranges(run.ranks.all_gather(input_range))
        run.memory.before_stage(stage, staged, work.weights, keep_dense)
        solved_runs = []
        for index, (names, scheme) in enumerate(runs[stage.name]):
            stage_owners = owners[stage.name]
            if stage_owners is not None and stage_owners[index] != run.ranks.rank:  # type: ignore[union-attr]
                solved_runs.append(None)  # another rank's: broadcast below
                continue
            weights = [get_module(work.block, name).weight.data for name in names]
            job = SolveJob(work.prefix, names, weights, hessian, scheme, run.storage, run.memory.parking)
            if hessian is not None:
                for step, data in zip(targets, stage_data, strict=True):
                    job.weights = step.hooks.target_weights(step.config, solver.config, job, data)
            del weights
            solved_runs.append(solver.hooks.solve(solver.config, job))
            del job
        if owners[stage.name] is not None:
            assert run.ranks is not None
            solved_runs = run.ranks.share_solved(solved_runs, owners[stage.name], staged.hidden.device)
        for (names, scheme), solved in zip(runs[stage.name], solved_runs, strict=True):
            unseen = stage.name in staged.unseen_stages  # no calibration row: the solve was round-to-nearest
            for name, (weight, record) in zip(names, solved, strict=True):
                record.fell_back_to_rtn = record.fell_back_to_rtn or unseen
                if input_range is not None and scheme.activations is not None and scheme.activations.static_scale:
                    weight.input_scale = input_range.scale(scheme.activations, run.storage, run.input_observer)
                work.write_back(name, weight)
                work.weights[name] = weight
                work.records.append(record)
        del hessian, stage_data, solved_runs


def _owners(run: BlockRun, block: nn.Module, runs: list[tuple[list[str], QuantScheme]]) -> list[int] | None:
    """The rank that solves each run, by cost (columns x rows; None on one process)."""
    if run.ranks is None:
        return None
    costs = [sum(get_module(block, name).weight.numel() for name in names) for names, _ in runs]
    return run.ranks.owners(costs)


def _record_routing(records: list[Any], prefix: str, staged: StagedBlock) -> None:
    """Each routed expert's linears record how many calibration tokens the router sent to that expert."""
    assert staged.experts is not None
    arch = staged.arch
    owner = {f"{prefix}.{name}": e for e in range(arch.num_experts) for name in arch.routed_expert_linears(e)}
    counts = staged.experts.counts.tolist()
    for record in records:
        expert = owner.get(record.name) if isinstance(record, LayerRecord) else None
        if expert is not None:
            record.routed_tokens = int(counts[expert])


def _quantize_data_free(block: nn.Module, prefix: str, schemes: BlockSchemes, run: BlockRun) -> QuantizedBlock:
    """Each linear straight from its stored weight: no calibration, no forward pass."""
    solver = run.steps.solver
    assert not run.steps.needs_calibration, "only data-free algorithms run without calibration windows"
    out = QuantizedBlock({}, None)
    runs = [([name], scheme) for name, scheme in schemes.items() if scheme is not None]
    owners = _owners(run, block, runs)  # several processes: each linear is solved by one rank and broadcast
    solved_runs = []
    for index, (names, scheme) in enumerate(runs):
        if owners is not None and owners[index] != run.ranks.rank:  # type: ignore[union-attr]
            solved_runs.append(None)
            continue
        stored = get_module(block, names[0]).weight.data
        job = SolveJob(prefix, names, [stored], None, scheme, run.storage)
        solved_runs.append(solver.hooks.solve(solver.config, job))
    if owners is not None:
        assert run.ranks is not None
        device = next(iter(block.parameters())).device
        solved_runs = run.ranks.share_solved(solved_runs, owners, device)
    for (names, _), ((weight, record),) in zip(runs, solved_runs, strict=True):
        out.weights[names[0]] = weight
        out.records.append(record)
    return out


# Rows of one stacked GPTQ solve in a mixture-of-experts gate/up stage (every expert's gate and up share the
# Hessian): the stacked copy grows with the number of experts (Qwen3-30B-A3B: 128 x 1536 rows, 1.6 GB in float32),
# so the experts are solved a few at a time against the same Hessian; rows are independent given it, so the codes
# are those of one solve.
MAX_STACKED_EXPERT_ROWS = 8192


def _solve_runs(
    linears: tuple[str, ...], schemes: BlockSchemes, block: nn.Module, moe: bool
) -> list[tuple[list[str], QuantScheme]]:
    """:func:`_same_scheme_runs`, with a run longer than ``MAX_STACKED_EXPERT_ROWS`` rows cut at linear boundaries
    in an MoE block (a dense block's runs stay whole)."""
    runs = _same_scheme_runs(linears, schemes)
    if not moe:
        return runs
    out = []
    for names, scheme in runs:
        chunk: list[str] = []
        rows = 0
        for name in names:
            n = get_module(block, name).weight.shape[0]
            if chunk and rows + n > MAX_STACKED_EXPERT_ROWS:
                out.append((chunk, scheme))
                chunk, rows = [], 0
            chunk.append(name)
            rows += n
        out.append((chunk, scheme))
    return out


def _same_scheme_runs(linears: tuple[str, ...], schemes: BlockSchemes) -> list[tuple[list[str], QuantScheme]]:
    """The stage's quantized linears grouped by scheme (a fused group always forms one run)."""
    runs: dict[QuantScheme, list[str]] = {}
    for name in linears:
        scheme = schemes.get(name)
        if scheme is not None:
            runs.setdefault(scheme, []).append(name)
    return [(names, scheme) for scheme, names in runs.items()]
