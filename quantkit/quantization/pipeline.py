"""Layer-by-layer quantization: prepare the job, quantize block after block, write the checkpoint.

Only one decoder block's weights are materialised at a time (the rest of the model stays on the meta device
and is read lazily from the safetensors shards), so models larger than RAM can be quantized. Each finished
block is saved to ``<output>.partial/`` and ``--resume`` continues after the last one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import closing, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from quantkit.data.model_calibration import calibration_for_model
from quantkit.device import peak_device_memory_mb, resolve_device
from quantkit.distributed.context import DistContext, current
from quantkit.distributed.faults import maybe_fail
from quantkit.errors import QuantkitError
from quantkit.faults import commit_point
from quantkit.format.files import RUN_LOG
from quantkit.memory import peak_rss_mb, release_freed_memory
from quantkit.model.blocks import BlockRunner
from quantkit.model.precision import compute_dtype, resolve_compute_dtype
from quantkit.model.source_weights import SourceWeights, build_skeleton
from quantkit.progress import Interrupted
from quantkit.quantization.block_loop import embed_inputs, walk_blocks
from quantkit.quantization.block_work import BlockRun
from quantkit.quantization.checkpoint_output import block_tensors, read_run_fingerprints, write_checkpoint
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.disk_space import check_free_space
from quantkit.quantization.distributed_run import RankBlocks, announce, check_distributable
from quantkit.quantization.input_ranges import sample_stride
from quantkit.quantization.job import QuantizeJob, num_layers_of, scheme_assignment
from quantkit.quantization.leftovers import remove_leftovers
from quantkit.quantization.methods.records import LayerRecord, record_from_dict
from quantkit.quantization.methods.registry import Role
from quantkit.quantization.output_lock import output_lock
from quantkit.quantization.quantize_block import quantize_block
from quantkit.quantization.spill import SpillFile
from quantkit.quantization.workdir import WorkDir, partial_dir

RESUME_HINT = "rerun with --resume to continue"


@dataclass(slots=True)
class QuantizeResult:
    output: Path
    method: str
    seconds: float
    peak_rss_mb: float
    checkpoint_bytes: int
    blocks: int
    resumed_from: int
    records: list[LayerRecord] = field(default_factory=list)
    already_complete: bool = False  # --resume found this run's finished checkpoint: nothing was redone
    device: str = "cpu"  # where the blocks were solved
    peak_device_mb: float | None = None  # peak memory allocated on an accelerator (None on the CPU)
    processes: int = 1  # torchrun's world size
    rank_seconds: list[float] = field(default_factory=list)  # several processes: each rank's time to the last block


def quantize_model(
    model: str | Path,
    config: QuantizeConfig | Any | Sequence[Any] | str | None,
    output: str | Path,
    *,
    on_block_done: Callable[[int], None] | None = None,
) -> QuantizeResult:
    """Quantize ``model`` (a float model: directory, hub id or alias) into a packed compressed-tensors checkpoint
    at ``output``; ``quantkit.quantize`` is this function.

    ``config``: a :class:`QuantizeConfig`, or what :meth:`QuantizeConfig.of` turns into one (a method such as
    ``"awq+gptq"``, one algorithm config, or a list of them). ``on_block_done(index)`` is called after
    each finished block.
    """
    config = QuantizeConfig.of(config)
    config.validate()
    output = Path(output)
    context = current()  # torchrun with several processes: this rank's place (None: one process)
    if context is not None:
        check_distributable(config, context)
        announce(context, str(model), config, output)  # a recipe's rank 0 calls the other ranks in
    main = context is None or context.is_main
    with output_lock(output) if main else nullcontext():  # one run per output, for the whole run (rank 0 writes)
        return _quantize(str(model), config, output, on_block_done, context)


def _quantize(
    model: str,
    config: QuantizeConfig,
    output: Path,
    on_block_done: Callable[[int], None] | None,
    context: DistContext | None = None,
) -> QuantizeResult:
    """The run; with several processes every rank runs it, and rank 0 alone reads and writes the output and the
    work directory (what it finds there is handed to the others)."""
    start = time.perf_counter()
    main = context is None or context.is_main
    if main:
        remove_leftovers(output)
    with SourceWeights(_float_source(model, output, config, main)) as weights:
        job = _prepare(model, config, output, weights)
        ranks = None if context is None else _rank_blocks(context, job)
        fingerprints = job.fingerprints()
        complete = main and output.exists() and read_run_fingerprints(output) == fingerprints and config.resume
        work = None if complete or not main else _open_work(job, output, fingerprints)
        finished = 0 if work is None else work.finished
        if ranks is not None:
            complete, finished = ranks.decide((complete, finished))
        if complete:
            if main:
                _retire(partial_dir(output))  # a run killed while cleaning up after its checkpoint was written
            records = _recorded_layers(output) if main else []
            return _result(job, start, job.num_layers, records, already_complete=True)
        resumed_from = finished
        try:
            with tempfile.TemporaryDirectory(prefix="quantkit-scratch-") as scratch:
                _run_blocks(job, work or WorkDir(Path(scratch), {}), finished, ranks, on_block_done)
            rank_seconds = [] if ranks is None else ranks.rank_seconds(time.perf_counter() - start)
            if work is not None:
                write_checkpoint(job, work)
        except KeyboardInterrupt as exc:  # the finished blocks are saved: say how far it got and how to go on
            if isinstance(exc, Interrupted):
                raise
            done = finished if work is None else work.finished
            raise Interrupted(done=done, total=job.num_layers, unit="block", hint=RESUME_HINT) from exc
        if work is not None:
            commit_point("checkpoint-written")
    if work is not None:
        shutil.rmtree(work.retire())
    result = _result(job, start, resumed_from, [] if work is None else work.layer_records)
    if context is not None:
        result.processes, result.rank_seconds = context.world, rank_seconds
    return result


def _open_work(job: QuantizeJob, output: Path, fingerprints: dict[str, str]) -> WorkDir:
    """The work directory (resumed or new), with the tensors outside the blocks an algorithm replaces."""
    config = job.config
    if output.exists() and not config.force:
        raise _output_exists(output)
    check_free_space(job)
    work = WorkDir.open(partial_dir(output), fingerprints, resume=config.resume, discard=config.force)
    if not work.has_outer:
        outer = {}
        for step in job.steps:
            outer |= step.hooks.outer_tensors(job.states.get(step.name), job)
        if outer:
            work.save_outer(outer)
    return work


def _rank_blocks(context: DistContext, job: QuantizeJob) -> RankBlocks:
    if job.calibration is None:
        return RankBlocks.data_free(context)
    return RankBlocks.plan(context, int(job.calibration.input_ids.shape[0]), job.config.batch_size)


def _result(
    job: QuantizeJob, start: float, resumed_from: int, records: list[LayerRecord], already_complete: bool = False
) -> QuantizeResult:
    return QuantizeResult(
        output=job.output,
        method=job.config.method,
        seconds=time.perf_counter() - start,
        peak_rss_mb=peak_rss_mb(),
        checkpoint_bytes=sum(f.stat().st_size for f in job.output.glob("*.safetensors")),
        blocks=job.num_layers,
        resumed_from=resumed_from,
        records=records,
        already_complete=already_complete,
        device=str(job.device),
        peak_device_mb=peak_device_memory_mb(job.device),
    )


def _retire(path: Path) -> None:
    if path.exists():
        shutil.rmtree(WorkDir(path, {}).retire())


def _recorded_layers(output: Path) -> list[LayerRecord]:
    log = json.loads((output / RUN_LOG).read_text())
    return [r for r in map(record_from_dict, log.get("layers", [])) if isinstance(r, LayerRecord)]


def _output_exists(output: Path) -> QuantkitError:
    return QuantkitError(f"output directory '{output}' exists; pass --force to replace it once the new one is complete")


def _float_source(model: str, output: Path, config: QuantizeConfig, main: bool = True) -> Path:
    from quantkit.model.resolve import arch_for_dir, is_quantized_dir, resolve_model

    source = resolve_model(model)
    arch_for_dir(source)  # an unsupported architecture fails before any work
    if is_quantized_dir(source):
        raise QuantkitError(f"'{model}' is already quantized; pass the original float model")
    if main and output.exists() and not config.force and not config.resume:  # --resume: it may be this run's
        raise _output_exists(output)
    return source


def _prepare(model: str, config: QuantizeConfig, output: Path, weights: SourceWeights) -> QuantizeJob:
    from quantkit.model.resolve import arch_for_dir, load_tokenizer

    source = weights.path
    arch = arch_for_dir(source)
    assignment = scheme_assignment(config, arch, weights)  # layouts are checked before any work
    calibration = None
    if config.needs_calibration:
        calibration = calibration_for_model(model, config.calibration, config.calibration_file, load_tokenizer(source))
    release_freed_memory()  # tokenization's temporaries
    device = resolve_device(config.device)
    # auto becomes this device's precision here, once: the fingerprint, the log and every pass read the resolved one
    config = replace(config, compute_dtype=resolve_compute_dtype(config.compute_dtype, device))
    job = QuantizeJob(
        model=model,
        config=config,
        source=source,
        output=output,
        arch=arch,
        num_layers=num_layers_of(source),
        weights=weights,
        storage=weights.storage_dtype(),
        assignment=assignment,
        calibration=calibration,
        steps=config.steps,
        device=device,
    )
    for step in job.steps:  # each algorithm's checks and job-wide state, before any work
        job.states[step.name] = step.hooks.prepare(step.config, job)
    return job


def _run_blocks(
    job: QuantizeJob,
    work: WorkDir,
    finished: int,
    ranks: RankBlocks | None,
    on_block_done: Callable[[int], None] | None,
) -> None:
    """The block loop. The block being solved, its statistics and the calibration activations live on
    ``job.device``; weights stream from the shards one block at a time, and what is saved goes back to the CPU.

    With several processes (``ranks``) each rank holds its own windows' activations; ``work`` is rank 0's work
    directory and, on the other ranks, a scratch directory of their own for the spill files (nothing is saved)."""
    main = ranks is None or ranks.context.is_main
    skeleton = build_skeleton(job.source)
    run = BlockRun(arch=job.arch, steps=job.steps, storage=job.storage, kv_cache=job.config.kv_cache, ranks=ranks)
    run.input_observer = job.config.activation_observer
    run.moe_calibration = job.config.moe_calibration
    device = job.device
    hidden: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    folds = [(step.hooks, job.states.get(step.name)) for step in job.steps.with_role(Role.ROTATION)]
    # round-to-nearest reads each weight once: the stored dtype, not a float32 copy of the whole block
    load_dtype = torch.float32 if job.steps.any_cap("loads_float32") else job.storage
    if job.calibration is not None:
        load_dtype = torch.float32
        seq_len, batch_size = job.calibration.seq_len, job.config.batch_size
        run.sample_every = sample_stride(job.calibration.input_ids.numel(), run.input_observer)
        precision = compute_dtype(job.config.compute_dtype)
        run.runner = BlockRunner.for_model(skeleton, job.arch, seq_len, batch_size, device, precision)
        if ranks is not None:  # this rank's windows: rank 0 hands out the saved input, or each cuts its own
            hidden = _rank_input(job, work, finished, ranks, skeleton, device)
        else:
            hidden = work.load_hidden(device) if finished > 0 else _first_input(job, work.load_outer(), skeleton)
            hidden = hidden.to(device)
        if job.steps.keeps_float_path:  # the float model's activations: the targets of tuning and refitting
            if finished > 0 and ranks is not None:
                reference = ranks.scatter_rows(work.load_reference() if main else None, device)
            else:
                reference = work.load_reference(device) if finished > 0 else hidden.clone()
    visits = walk_blocks(
        skeleton,
        job.arch,
        job.weights,
        description=f"Quantizing ({job.config.method})",
        first=finished,
        dtype=load_dtype,
        device=device,
        show_progress=job.config.show_progress and main,  # progress from rank 0 only
    )
    with SpillFile(work.spill_file) as spill, closing(visits):  # closing: the bar stops before Ctrl-C's message
        run.memory = work.memory_strategy(device, spill)
        for visit in visits:
            for hooks, state in folds:
                hooks.fold(state, visit.module, visit.index)
            schemes = job.assignment.for_block(visit.prefix)
            layer_run = replace(run, arch=job.arch.for_layer(visit.index)) if job.arch.mixers else run  # hybrid
            if ranks is not None:
                maybe_fail(ranks.rank, visit.index)
            done = quantize_block(visit.module, visit.prefix, hidden, schemes, layer_run, reference)
            hidden, reference = done.output, done.reference_output
            saved = hidden if ranks is None or hidden is None else ranks.gather_rows(hidden)  # all windows, rank 0
            saved_reference = reference if ranks is None or reference is None else ranks.gather_rows(reference)
            if main:
                tensors = block_tensors(visit.module, visit.prefix, done.weights, job.storage, done.extra)
                work.save_block(visit.index, tensors, saved, done.records, saved_reference)
                del tensors
                if on_block_done is not None:
                    on_block_done(visit.index)
            del done, saved, saved_reference


def _rank_input(
    job: QuantizeJob, work: WorkDir, finished: int, ranks: RankBlocks, skeleton: torch.nn.Module, device: torch.device
) -> torch.Tensor:
    """This rank's rows of the next block's input: the saved one, or the first block's, handed out by rank 0; when
    no tensor outside the blocks replaces the source's (a rotated embedding, kept by rank 0 alone), each rank cuts
    its own rows of the source's embedding."""
    main = ranks.context.is_main
    if finished > 0:
        return ranks.scatter_rows(work.load_hidden() if main else None, device)
    outer = work.load_outer() if main else {}
    if ranks.decide(bool(outer)):
        return ranks.scatter_rows(_first_input(job, outer, skeleton) if main else None, device)
    return _first_input(job, {}, skeleton)[ranks.rows].clone().to(device)


def _first_input(job: QuantizeJob, outer: dict[str, torch.Tensor], skeleton: torch.nn.Module) -> torch.Tensor:
    """The first block's calibration input: an algorithm's (the rows of a rotated embedding, from ``outer``: the
    work directory's tensors outside the blocks), else the source's embedding of the windows."""
    assert job.calibration is not None
    ids = job.calibration.input_ids
    for step in job.steps:
        first = step.hooks.first_input(job.states.get(step.name), outer, ids, job.storage)
        if first is not None:
            return first
    return embed_inputs(skeleton, job.arch, job.weights, ids, job.storage)
