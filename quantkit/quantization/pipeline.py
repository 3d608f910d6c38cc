"""Layer-by-layer quantization: prepare the job, quantize block after block, write the checkpoint.

Only one decoder block's weights are materialised at a time (the rest of the model stays on the meta device
and is read lazily from the safetensors shards), so models larger than RAM can be quantized. Each finished
block is saved to ``<output>.partial/`` and ``--resume`` continues after the last one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.data.model_calibration import calibration_for_model
from quantkit.device import peak_device_memory_mb, resolve_device
from quantkit.errors import QuantkitError
from quantkit.faults import commit_point
from quantkit.format.files import RUN_LOG
from quantkit.memory import peak_rss_mb, release_freed_memory
from quantkit.model.blocks import BlockRunner
from quantkit.model.source_weights import SourceWeights, build_skeleton
from quantkit.progress import Interrupted
from quantkit.quantization.block_loop import embed_inputs, walk_blocks
from quantkit.quantization.block_work import BlockRun
from quantkit.quantization.checkpoint_output import block_tensors, read_run_fingerprints, write_checkpoint
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.disk_space import check_free_space
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
    with output_lock(output):  # one run per output, for the whole run
        return _quantize(str(model), config, output, on_block_done)


def _quantize(
    model: str, config: QuantizeConfig, output: Path, on_block_done: Callable[[int], None] | None
) -> QuantizeResult:
    start = time.perf_counter()
    remove_leftovers(output)
    with SourceWeights(_float_source(model, output, config)) as weights:
        job = _prepare(model, config, output, weights)
        fingerprints = job.fingerprints()
        if output.exists() and read_run_fingerprints(output) == fingerprints and config.resume:
            _retire(partial_dir(output))  # a run killed while cleaning up after its checkpoint was written
            return _result(job, start, job.num_layers, _recorded_layers(output), already_complete=True)
        if output.exists() and not config.force:
            raise _output_exists(output)
        check_free_space(job)
        work = WorkDir.open(partial_dir(output), fingerprints, resume=config.resume, discard=config.force)
        resumed_from = work.finished
        if not work.has_outer:
            outer = {}
            for step in job.steps:
                outer |= step.hooks.outer_tensors(job.states.get(step.name), job)
            if outer:
                work.save_outer(outer)
        try:
            _run_blocks(job, work, on_block_done)
            write_checkpoint(job, work)
        except KeyboardInterrupt as exc:  # the finished blocks are saved: say how far it got and how to go on
            if isinstance(exc, Interrupted):
                raise
            raise Interrupted(done=work.finished, total=job.num_layers, unit="block", hint=RESUME_HINT) from exc
        commit_point("checkpoint-written")
    shutil.rmtree(work.retire())
    return _result(job, start, resumed_from, work.layer_records)


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


def _float_source(model: str, output: Path, config: QuantizeConfig) -> Path:
    from quantkit.model.resolve import arch_for_dir, is_quantized_dir, resolve_model

    source = resolve_model(model)
    arch_for_dir(source)  # an unsupported architecture fails before any work
    if is_quantized_dir(source):
        raise QuantkitError(f"'{model}' is already quantized; pass the original float model")
    if output.exists() and not config.force and not config.resume:  # --resume: it may be this run's, finished
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
        device=resolve_device(config.device),
    )
    for step in job.steps:  # each algorithm's checks and job-wide state, before any work
        job.states[step.name] = step.hooks.prepare(step.config, job)
    return job


def _run_blocks(job: QuantizeJob, work: WorkDir, on_block_done: Callable[[int], None] | None) -> None:
    """The block loop. The block being solved, its statistics and the calibration activations live on
    ``job.device``; weights stream from the shards one block at a time, and what is saved goes back to the CPU."""
    skeleton = build_skeleton(job.source)
    run = BlockRun(arch=job.arch, steps=job.steps, storage=job.storage, kv_cache=job.config.kv_cache)
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
        run.runner = BlockRunner.for_model(skeleton, job.arch, seq_len, batch_size, device=device)
        hidden = work.load_hidden(device) if work.finished > 0 else _first_input(job, work, skeleton).to(device)
        if job.steps.keeps_float_path:  # the float model's activations: the targets of tuning and refitting
            reference = work.load_reference(device) if work.finished > 0 else hidden.clone()
    visits = walk_blocks(
        skeleton,
        job.arch,
        job.weights,
        description=f"Quantizing ({job.config.method})",
        first=work.finished,
        dtype=load_dtype,
        device=device,
        show_progress=job.config.show_progress,
    )
    with SpillFile(work.spill_file) as spill, closing(visits):  # closing: the bar stops before Ctrl-C's message
        run.memory = work.memory_strategy(device, spill)
        for visit in visits:
            for hooks, state in folds:
                hooks.fold(state, visit.module)
            schemes = job.assignment.for_block(visit.prefix)
            done = quantize_block(visit.module, visit.prefix, hidden, schemes, run, reference)
            hidden, reference = done.output, done.reference_output
            tensors = block_tensors(visit.module, visit.prefix, done.weights, job.storage, done.extra)
            work.save_block(visit.index, tensors, hidden, done.records, reference)
            del done, tensors
            if on_block_done is not None:
                on_block_done(visit.index)


def _first_input(job: QuantizeJob, work: WorkDir, skeleton: torch.nn.Module) -> torch.Tensor:
    """The first block's calibration input: an algorithm's (the rows of a rotated embedding), else the source's
    embedding of the windows."""
    assert job.calibration is not None
    ids, outer = job.calibration.input_ids, work.load_outer()
    for step in job.steps:
        first = step.hooks.first_input(job.states.get(step.name), outer, ids, job.storage)
        if first is not None:
            return first
    return embed_inputs(skeleton, job.arch, job.weights, ids, job.storage)
