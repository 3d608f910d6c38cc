"""A float model into one GGUF file of llama.cpp's own types, one decoder block in memory at a time.

The walk is the compressed-tensors pipeline's (:func:`~quantkit.quantization.block_loop.walk_blocks`,
:class:`~quantkit.model.staged_block.StagedBlock`, :func:`~quantkit.quantization.block_loop.stage_hessians`):
each stage's linears are solved on the Hessian of inputs computed with every earlier stage already quantized,
each one onto the GGML type the mix gives it, and its decoded weight is written back into the block, so later
stages and blocks see the model llama.cpp will run. The first block reads the quantized embedding. An untied
output head is solved last, on the Hessian of the final norm's output. With a rotation (:mod:`.rotate`) each block
is folded as it is loaded, before its Hessians are taken, and the embedding, head and final norm are the rotated
ones; the head is then untied. With float targets (:mod:`.float_path`) the float model's stream runs beside the
quantized one, from the float embedding's rows, and each linear is solved toward the float model's outputs.

Each tensor's bytes go to a work directory beside the output (not kept in memory); the file is then written by
the caller's writer (:func:`quantkit.export.gguf_typed.write_typed_gguf`: the quantizer does not import exports)
under a temporary name, flushed and renamed into place. Nothing is left under the output name on failure. The run
holds the output's lock (:mod:`quantkit.quantization.output_lock`) throughout, so a second run on the same file is
refused, and it removes what a killed run left beside the file.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.atomic import publish, remove_path
from quantkit.data.calibration import CalibrationConfig, CalibrationSet
from quantkit.device import resolve_device
from quantkit.errors import QuantkitError
from quantkit.format.gguf_file import tensor_nbytes
from quantkit.memory import peak_rss_mb
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.model.source_weights import SourceWeights, build_skeleton, load_module, release_module
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.block_loop import stage_hessians, walk_blocks
from quantkit.quantization.gguf.float_path import FloatStream, check_float_targets
from quantkit.quantization.gguf.mixes import mix_of
from quantkit.quantization.gguf.plan import DENSE, EMBEDDING, HEAD, LINEAR, PlannedTensor, plan_gguf
from quantkit.quantization.gguf.rotate import GGUFRotation, gguf_rotation
from quantkit.quantization.gguf.solve import GPTQ, METHODS, SolvedTensor, SolveSettings, solve_tensor
from quantkit.quantization.leftovers import remove_leftovers
from quantkit.quantization.output_lock import output_lock
from quantkit.quantization.statistics import HessianStat

Writer = Callable[..., int]  # write_typed_gguf(source, plan, data_of, out_file, file_type=...)


@dataclass
class GGUFOutputConfig:
    mix: str = "Q4_K_M"
    solve: SolveSettings = field(default_factory=SolveSettings)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    calibration_file: Path | None = None
    types: dict[str, str] | None = None  # HF name -> GGML type (a budget plan); None: the mix's choice
    batch_size: int = 4
    force: bool = False
    device: str = "cpu"
    show_progress: bool = True
    rotation: Any = None  # a RotationConfig folded before solving (--rotate); None: none
    float_targets: Any = None  # a FloatTargetsConfig: GPTQ fits the float model's outputs (see float_path); None: no


@dataclass(slots=True)
class TensorRecord:
    name: str  # GGUF name
    hf_name: str
    type: str
    wanted: str  # the mix's type before llama.cpp's row-length fallback
    shape: list[int]
    params: int
    bytes: int
    # the solver's Hessian-weighted error (None: copied, not solved); with float targets against the target W*, the
    # part of the float-output error that depends on the solve (see float_path)
    loss: float | None
    fell_back_to_rtn: bool = False


@dataclass(slots=True)
class GGUFResult:
    output: Path
    mix: str
    method: str
    seconds: float
    file_bytes: int
    peak_rss_mb: float
    tensors: list[TensorRecord] = field(default_factory=list)
    rotation: str = "none"  # e.g. "hadamard-s0": what was folded into the weights
    float_targets: bool = False  # each linear was solved toward the float model's outputs


def check_output(output: Path, force: bool) -> None:
    if output.suffix != ".gguf":
        raise QuantkitError(f"a GGUF output is one file: name it with .gguf (got '{output}')")
    if output.exists() and not force:
        raise QuantkitError(f"{output} exists; pass --force to replace it once the new file is complete")


def quantize_to_gguf(model: str, config: GGUFOutputConfig, output: Path, write: Writer) -> GGUFResult:
    """Quantize ``model`` (directory, hub id or alias) into the GGUF file ``output`` with ``config.mix``."""
    start = time.perf_counter()
    output = Path(output)
    mix_of(config.mix)  # an unknown mix is refused before anything else
    if config.solve.method not in METHODS:
        raise QuantkitError(f"GGUF output solves with {' or '.join(METHODS)}; got method '{config.solve.method}'")
    if config.float_targets is not None:
        check_float_targets(config.solve.method)  # GPTQ only, in the compressed-tensors path's words
    check_output(output, config.force)
    with output_lock(output):
        check_output(output, config.force)  # again: a run that held the lock may have just finished the file
        remove_leftovers(output)
        return _quantize_locked(model, config, output, write, start)


def _quantize_locked(model: str, config: GGUFOutputConfig, output: Path, write: Writer, start: float) -> GGUFResult:
    from quantkit.data.model_calibration import calibration_for_model
    from quantkit.model.resolve import arch_for_dir, is_quantized_dir, load_tokenizer, resolve_model

    mix = mix_of(config.mix)
    source = resolve_model(model)
    if is_quantized_dir(source):
        raise QuantkitError(f"'{model}' is already quantized; pass the original float model")
    arch = arch_for_dir(source)
    with SourceWeights(source) as weights:
        rotation = gguf_rotation(config.rotation, source, arch, weights)  # checked before any work
        plan = plan_gguf(weights, arch, mix, config.types, untie_head=rotation is not None)
        calibration = None
        if config.solve.method == GPTQ:
            tokenizer = load_tokenizer(source)
            calibration = calibration_for_model(model, config.calibration, config.calibration_file, tokenizer)
        output.parent.mkdir(parents=True, exist_ok=True)
        work = output.with_name(f".{output.name}.work-{os.getpid()}")
        tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
        remove_path(work)
        work.mkdir()
        try:
            store = _Store(work, weights)
            records = _solve_all(plan, arch, weights, calibration, config, store, rotation)
            file_type = None if config.types is not None else mix.file_type
            write(source, plan, store.data_of, tmp, file_type=file_type)
            publish(tmp, output, overwrite=config.force)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise QuantkitError(
                    f"no space left on the device of {output.parent}; free space and run again"
                ) from exc
            raise
        finally:
            remove_path(tmp)
            remove_path(work)
    name = "auto" if config.types is not None else mix.name
    size = output.stat().st_size
    seconds = time.perf_counter() - start
    folded = "none" if rotation is None else rotation.job.config.name
    return GGUFResult(
        output,
        name,
        config.solve.method,
        seconds,
        size,
        peak_rss_mb(),
        records,
        folded,
        config.float_targets is not None,
    )


class _Store:
    """Each solved tensor's bytes in its own file under the work directory; dense tensors read from the source."""

    def __init__(self, root: Path, weights: SourceWeights) -> None:
        self.root, self.weights = root, weights
        self.files: dict[str, Path] = {}

    def put(self, hf_name: str, data: np.ndarray) -> None:
        path = self.root / f"{len(self.files)}.npy"
        np.save(path, np.ascontiguousarray(data))
        self.files[hf_name] = path

    def data_of(self, tensor: Any) -> np.ndarray:
        if tensor.hf_name in self.files:
            return np.load(self.files[tensor.hf_name], mmap_mode="r")
        return self.weights.get(tensor.hf_name).float().numpy()


def _solve_all(
    plan: list[PlannedTensor],
    arch: ArchSpec,
    weights: SourceWeights,
    calibration: CalibrationSet | None,
    config: GGUFOutputConfig,
    store: _Store,
    rotation: GGUFRotation | None = None,
) -> list[TensorRecord]:
    by_name = {t.hf_name: t for t in plan}
    records: dict[str, TensorRecord] = {}

    def keep(t: PlannedTensor, solved: SolvedTensor | None) -> None:
        if solved is not None:
            store.put(t.hf_name, solved.data)
        records[t.hf_name] = _record_of(t, solved)

    device = resolve_device(config.device)
    skeleton = build_skeleton(weights.path)
    embedding = next(t for t in plan if t.role == EMBEDDING)
    emb_source = weights.get(embedding.hf_name) if rotation is None else rotation.take(embedding.hf_name, weights)
    emb = solve_tensor(emb_source, None, embedding.type, config.solve, embedding.hf_name)
    hidden = None
    runner = None
    floats = None  # the float model's stream, with float targets
    if calibration is not None:
        ids = calibration.input_ids
        hidden = torch.nn.functional.embedding(ids, emb.dequantized).to(device)
        runner = BlockRunner.for_model(skeleton, arch, calibration.seq_len, config.batch_size, device=device)
        if config.float_targets is not None:  # from the float (rotated) embedding's rows; the quantized stream from
            # the decoded ones
            reference = torch.nn.functional.embedding(ids, emb_source.float()).to(device)
            floats = FloatStream(reference, config.float_targets, config.solve.gptq)
    del emb_source
    keep(embedding, emb)
    del emb
    visits = walk_blocks(
        skeleton,
        arch,
        weights,
        description=f"GGUF {config.mix} ({config.solve.method})",
        device=device,
        show_progress=config.show_progress,
    )
    for visit in visits:
        if rotation is not None:
            # before any Hessian: GPTQ solves the rotated weights on rotated inputs
            rotation.fold(visit.module, visit.index)
            dense = [t.hf_name for t in plan if t.role == DENSE and t.hf_name.startswith(f"{visit.prefix}.")]
            for hf_name, value in rotation.dense_of(visit.module, visit.prefix, dense).items():
                store.put(hf_name, value)  # the norms are ones now (and a rotated bias is no longer the source's)
        linears = {f"{visit.prefix}.{name}": name for name in arch.linears}
        if runner is None or hidden is None:
            for full, name in linears.items():
                t = by_name[f"{full}.weight"]
                keep(t, solve_tensor(get_module(visit.module, name).weight.data, None, t.type, config.solve, full))
            continue
        # the float block (after the fold, before any linear is quantized) beside the quantized one
        companions = [] if floats is None else [floats.companion(visit.module, arch, runner)]
        staged = StagedBlock(visit.module, arch, runner, hidden)
        with torch.inference_mode():  # no autograd anywhere here; the Hessians may be inference tensors
            for stage, hessian, stage_data in stage_hessians(staged, companions=companions):
                assert hessian is not None
                for name in stage.linears:
                    full = f"{visit.prefix}.{name}"
                    t = by_name[f"{full}.weight"]
                    linear = get_module(visit.module, name)
                    weight = linear.weight.data
                    if floats is not None:
                        weight = floats.target(name, weight, hessian, stage_data[0])
                    solved = solve_tensor(weight, hessian, t.type, config.solve, full)
                    linear.weight.data.copy_(solved.dequantized.to(linear.weight.device, linear.weight.dtype))
                    keep(t, solved)
                del hessian, stage_data
            hidden = staged.output()
            if floats is not None:
                floats.advance(companions[0])
        del companions
    floats = None  # the head is solved on the quantized stream alone
    norm_name = f"{arch.final_norm_path}.weight"
    norm = None if rotation is None else rotation.take(norm_name, weights)
    if norm is not None:
        store.put(norm_name, norm.numpy())
    head = next((t for t in plan if t.role == HEAD), None)
    if head is not None:
        h = _head_hessian(skeleton, arch, weights, hidden, config.batch_size, norm) if hidden is not None else None
        head_source = weights.get(head.hf_name) if rotation is None else rotation.take(head.hf_name, weights)
        keep(head, solve_tensor(head_source, h, head.type, config.solve, head.hf_name))
    for t in plan:
        if t.role == DENSE:
            keep(t, None)
    missing = [t.hf_name for t in plan if t.hf_name not in records]
    assert not missing, f"tensors not produced: {missing[:3]}"
    assert all(t.role in (LINEAR, EMBEDDING, HEAD, DENSE) for t in plan)
    return [records[t.hf_name] for t in plan]


def _head_hessian(
    skeleton: torch.nn.Module,
    arch: ArchSpec,
    weights: SourceWeights,
    hidden: torch.Tensor,
    batch_size: int,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Hessian of the head's inputs: the final norm (with ``norm_weight`` when given: a folded rotation's
    ones) of the last block's output, over every window."""
    norm = get_module(skeleton, arch.final_norm_path)
    load_module(norm, arch.final_norm_path, weights, device=hidden.device)
    if norm_weight is not None:
        norm.weight.data.copy_(norm_weight.to(norm.weight.device, norm.weight.dtype))
    stat = HessianStat.zeros(hidden.shape[-1], device=hidden.device)
    with torch.inference_mode():
        for start in range(0, hidden.shape[0], batch_size):
            stat.update(norm(hidden[start : start + batch_size].float()))
    release_module(norm)
    return stat.take_hessian()


def _record_of(t: PlannedTensor, solved: SolvedTensor | None) -> TensorRecord:
    return TensorRecord(
        name=t.name,
        hf_name=t.hf_name,
        type=t.type,
        wanted=t.choice.wanted,
        shape=list(t.shape),
        params=t.params,
        bytes=tensor_nbytes(t.type, t.shape),
        loss=None if solved is None else solved.loss,
        fell_back_to_rtn=False if solved is None else solved.fell_back_to_rtn,
    )
