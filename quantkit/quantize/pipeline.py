"""Layer-by-layer quantization: capture a block's inputs, collect statistics, solve, pack, save, move on.

Only one decoder block's weights are materialised at a time (the rest of the model stays on the meta device
and is read lazily from the safetensors shards), so models larger than RAM can be quantized. Each finished
block is saved to ``<output>.partial/`` and ``--resume`` continues after the last one.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit.data.calibration import CalibrationSet, build_calibration
from quantkit.data.calibration_config import CalibrationConfig
from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner, embed, get_module
from quantkit.model.source_weights import SourceWeights, build_skeleton, config_json, load_module, release_module
from quantkit.progress import progress_bar
from quantkit.quantize.assignment import SchemeAssignment, uniform_assignment
from quantkit.quantize.awq_block import AWQBlockReport, apply_awq_to_block
from quantkit.quantize.config import QuantizeConfig
from quantkit.quantize.memory import peak_rss_mb, release_freed_memory
from quantkit.quantize.methods import with_solver_options
from quantkit.quantize.solvers.gptq import GPTQConfig, gptq_solve, hessian_weighted_error
from quantkit.quantize.solvers.grid import quantize_rtn
from quantkit.quantize.spill import SpillFile
from quantkit.quantize.staged_block import StagedBlock
from quantkit.quantize.statistics import HessianStat
from quantkit.quantize.workdir import WorkDir, partial_dir

LOG_FILE = "quantkit_log.json"
_NOT_COPIED = {"config.json", "model.safetensors.index.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


@dataclass(slots=True)
class LayerRecord:
    name: str
    scheme: str
    loss: float | None  # GPTQ objective tr(dW H dW^T); None for round-to-nearest
    damp: float | None
    fell_back_to_rtn: bool = False


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


def quantize_model(config: QuantizeConfig, *, on_block_done=None) -> QuantizeResult:
    """Quantize ``config.model`` into a packed compressed-tensors checkpoint at ``config.output``."""
    from quantkit.model.resolve import arch_for_dir, is_quantized_dir, load_tokenizer, resolve_model

    config.validate()
    start = time.perf_counter()
    source = resolve_model(config.model)
    arch = arch_for_dir(source)
    if is_quantized_dir(source):
        raise QuantkitError(f"'{config.model}' is already quantized; pass the original float model")
    output = Path(config.output)
    if output.exists() and not config.force:
        raise QuantkitError(
            f"output directory '{output}' exists; pass --force to replace it once the new one is complete"
        )
    # Round-to-nearest needs no activations: no calibration data, no forward passes, block by block all the same.
    calibration = None if config.method == "rtn" else _calibration(config, load_tokenizer(source))
    release_freed_memory()  # tokenization's temporaries
    num_layers = int(config_json(source)["num_hidden_layers"])
    assignment = _assignment(config, arch, num_layers)
    with SourceWeights(source) as weights:
        storage = weights.storage_dtype()
        fingerprints = {
            "model": weights.fingerprint(),
            "calibration data": "none"
            if calibration is None
            else hashlib.sha256(calibration.input_ids.numpy().tobytes()).hexdigest()[:16],
            "scheme": _scheme_fingerprint(config, assignment),
        }
        work = WorkDir.open(partial_dir(output), fingerprints, resume=config.resume)
        resumed_from = work.finished
        _run_blocks(config, arch, source, weights, calibration, assignment, storage, work, on_block_done)
        records = [LayerRecord(**r) for r in work.records if "kind" not in r]
        _write_checkpoint(config, arch, source, weights, assignment, work, calibration, records, storage)
    work.remove()
    return QuantizeResult(
        output=output,
        method=config.method,
        seconds=time.perf_counter() - start,
        peak_rss_mb=peak_rss_mb(),
        checkpoint_bytes=sum(f.stat().st_size for f in output.glob("*.safetensors")),
        blocks=num_layers,
        resumed_from=resumed_from,
        records=records,
    )


def _calibration(config: QuantizeConfig, tokenizer) -> CalibrationSet:
    return calibration_for_model(
        config.model, config.calib, tokenizer, config.num_samples, config.seq_len, config.seed, config.show_progress
    )


def calibration_for_model(
    model: str, calib: Path | None, tokenizer, num_samples: int, seq_len: int, seed: int, show_progress: bool
) -> CalibrationSet:
    """The calibration file (checked against the model's tokenizer), or windows from the shipped corpus."""
    from quantkit.model.resolve import tokenizer_fingerprint

    if calib is None:
        built = build_calibration(
            CalibrationConfig(
                model=model, num_samples=num_samples, seq_len=seq_len, seed=seed, show_progress=show_progress
            ),
            tokenizer,
        )
        return built.calibration
    calibration = CalibrationSet.load(Path(calib))
    if calibration.metadata.get("tokenizer_hash") != tokenizer_fingerprint(tokenizer):
        raise QuantkitError(
            f"calibration file '{calib}' was made with another tokenizer "
            f"({calibration.metadata.get('tokenizer', '?')}); "
            f"rebuild it with `quantkit calibrate --model {model}`"
        )
    if int(calibration.input_ids.max()) >= len(tokenizer):
        raise QuantkitError(f"calibration file '{calib}' holds token ids outside the model's vocabulary")
    return calibration


def _assignment(config: QuantizeConfig, arch: ArchSpec, num_layers: int) -> SchemeAssignment:
    if config.plan is not None:
        from quantkit.mixed.plan_apply import assignment_from_plan

        planned = assignment_from_plan(Path(config.plan), arch, num_layers)
        return SchemeAssignment(
            {name: None if s is None else with_solver_options(s, config.scheme) for name, s in planned.schemes.items()}
        )
    return uniform_assignment(arch, num_layers, config.scheme, config.ignore)


def _scheme_fingerprint(config: QuantizeConfig, assignment: SchemeAssignment) -> str:
    spec = {
        "method": config.method,
        "awq": asdict(config.awq) if config.method.startswith("awq") else None,
        "damp": config.damp,
        "block_size": config.block_size,
        "batch_size": config.batch_size,
        "schemes": {name: (asdict(s) if s else None) for name, s in assignment.schemes.items()},
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _run_blocks(
    config: QuantizeConfig,
    arch: ArchSpec,
    source: Path,
    weights: SourceWeights,
    calibration: CalibrationSet | None,
    assignment: SchemeAssignment,
    storage: torch.dtype,
    work: WorkDir,
    on_block_done,
) -> None:
    model = build_skeleton(source)
    layers = get_module(model, arch.layers_path)
    hidden: torch.Tensor | None = None
    spill = SpillFile(work.spill_file)
    if calibration is None:  # round-to-nearest needs no activations

        def step(block: nn.Module, prefix: str, hidden: torch.Tensor | None):
            quantized, records = _rtn_block(block, prefix, assignment.for_block(prefix), storage)
            return quantized, None, records

    else:
        runner = BlockRunner.for_model(model, arch, calibration.seq_len, config.batch_size)
        if work.finished == 0:
            embedding = get_module(model, arch.embed_path)
            load_module(embedding, arch.embed_path, weights, dtype=storage)
            hidden = embed(model, arch, calibration.input_ids, storage)
            release_module(embedding)
        else:
            hidden = work.load_hidden()
        gptq = GPTQConfig(damp=config.damp, block_size=config.block_size)

        def step(block: nn.Module, prefix: str, hidden: torch.Tensor | None):
            schemes = assignment.for_block(prefix)
            return quantize_block(block, prefix, arch, runner, hidden, schemes, config, gptq, storage, spill=spill)

    with progress_bar(config.show_progress) as bar, spill:
        task = bar.add_task(f"Quantizing ({config.method})", total=len(layers), completed=work.finished)
        for index in range(work.finished, len(layers)):
            prefix = f"{arch.layers_path}.{index}"
            block = layers[index]
            # round-to-nearest reads each weight once: the stored dtype, not a float32 copy of the whole block
            load_module(block, prefix, weights, dtype=storage if calibration is None else torch.float32)
            quantized, hidden, records = step(block, prefix, hidden)
            work.save_block(index, block_tensors(block, prefix, quantized, storage), hidden, records)
            release_module(block)
            del quantized
            release_freed_memory()
            bar.advance(task)
            if on_block_done is not None:
                on_block_done(index)


def _rtn_block(
    block: nn.Module, prefix: str, schemes: dict[str, QuantScheme | None], storage: torch.dtype
) -> tuple[dict[str, QuantizedWeight], list[dict]]:
    """Round-to-nearest of one block's linears, straight from their weights."""
    quantized: dict[str, QuantizedWeight] = {}
    records: list[dict] = []
    for name, scheme in schemes.items():
        if scheme is not None:
            quantized[name] = quantize_rtn(get_module(block, name).weight.data, scheme, scale_dtype=storage)
            records.append(asdict(LayerRecord(f"{prefix}.{name}", scheme.name, None, None)))
    return quantized, records


def quantize_block(
    block: nn.Module,
    prefix: str,
    arch: ArchSpec,
    runner: BlockRunner,
    hidden: torch.Tensor,
    schemes: dict[str, QuantScheme | None],
    config: QuantizeConfig,
    gptq: GPTQConfig,
    storage: torch.dtype,
    spill: SpillFile | None = None,
) -> tuple[dict[str, QuantizedWeight], torch.Tensor, list[dict]]:
    """Quantize one block in place (its linears end up holding their dequantized weights).

    Returns the quantized weights by relative name, the block's output on the calibration inputs (the next
    block's input, computed with the quantized weights), and one record per quantized linear. The output is
    written over ``hidden`` (one activation buffer less); pass a clone to keep the input. ``spill``: a scratch
    file for down_proj's inputs, so the output pass need not recompute them (see :class:`StagedBlock`).
    """
    quantized: dict[str, QuantizedWeight] = {}
    records: list[dict] = []
    use_hessian = config.method in ("gptq", "awq+gptq")
    if config.method in ("awq", "awq+gptq"):
        report = apply_awq_to_block(block, arch, hidden, runner, schemes, config.awq, scale_dtype=storage)
        records.extend(_awq_records(prefix, report))
    staged = StagedBlock(block, arch, runner, hidden, spill=spill)
    for stage_index, stage in enumerate(arch.sequential_stages):
        in_features = get_module(block, stage[0]).in_features
        stat = _stage_hessian(staged, stage_index, in_features if use_hessian else None)
        hessian = None if stat is None else stat.hessian()
        del stat
        release_freed_memory()  # the stage's mini-batch temporaries, before the solver allocates its own
        for names, scheme in _same_scheme_runs(stage, schemes):
            linears = [get_module(block, name) for name in names]
            fulls = [f"{prefix}.{name}" for name in names]
            weights = [linear.weight.data for linear in linears]
            if hessian is not None:
                solved = _solve_stacked(weights, hessian, scheme, gptq, storage, fulls)
            else:
                solved = [
                    (quantize_rtn(w, scheme, scale_dtype=storage), LayerRecord(f, scheme.name, None, None))
                    for w, f in zip(weights, fulls, strict=True)
                ]
            for name, linear, (qw, record) in zip(names, linears, solved, strict=True):
                linear.weight.data = qw.dequantize(torch.float32)
                quantized[name] = qw
                records.append(asdict(record))
    release_freed_memory()
    return quantized, staged.output(), records


def _stage_hessian(staged: StagedBlock, stage_index: int, in_features: int | None) -> HessianStat | None:
    """Run one stage over every mini-batch; the Hessian of its inputs (None: just run it, for its caches)."""
    hessian = None if in_features is None else HessianStat.zeros(in_features)
    for x in staged.stage_inputs(stage_index):
        if hessian is not None:
            hessian.update(x)
    return hessian


def _same_scheme_runs(
    stage: tuple[str, ...], schemes: dict[str, QuantScheme | None]
) -> list[tuple[list[str], QuantScheme]]:
    """The stage's quantized linears grouped by scheme (a fused group always forms one run)."""
    runs: dict[QuantScheme, list[str]] = {}
    for name in stage:
        scheme = schemes.get(name)
        if scheme is not None:
            runs.setdefault(scheme, []).append(name)
    return [(names, scheme) for scheme, names in runs.items()]


def _solve_stacked(
    weights: list[torch.Tensor],
    hessian: torch.Tensor,
    scheme: QuantScheme,
    gptq: GPTQConfig,
    storage: torch.dtype,
    names: list[str],
) -> list[tuple[QuantizedWeight, LayerRecord]]:
    """GPTQ on linears that share an input (one Hessian): rows are independent given H, so solving the
    row-stacked matrix once equals solving each linear alone, with one factorisation and one column sweep."""
    result = gptq_solve(torch.cat(weights), hessian, scheme, gptq, scale_dtype=storage, name=", ".join(names))
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


def _awq_records(prefix: str, report: AWQBlockReport) -> list[dict]:
    """AWQ's choices, logged beside the solver records (kind "awq-scale" / "awq-clip")."""
    out = [
        {
            "name": f"{prefix}.{g.prev}",
            "kind": "awq-scale",
            "ratio": g.ratio,
            "rtn_error": g.rtn_error,
            "awq_error": g.awq_error,
        }
        for g in report.groups
    ]
    out += [{"name": f"{prefix}.{c.linear}", "kind": "awq-clip", "mean_shrink": c.mean_shrink} for c in report.clips]
    return out


def block_tensors(
    block: nn.Module, prefix: str, quantized: dict[str, QuantizedWeight], storage: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one block: packed quantized linears, everything else in the storage dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in block.state_dict().items():
        module_name = name.rpartition(".")[0]
        if module_name in quantized and name.endswith(".weight"):
            continue
        tensors[f"{prefix}.{name}"] = tensor.to(storage) if tensor.is_floating_point() else tensor.clone()
    for name, qw in quantized.items():
        tensors.update(linear_tensors(f"{prefix}.{name}", qw, storage))
    return tensors


def _write_checkpoint(
    config: QuantizeConfig,
    arch: ArchSpec,
    source: Path,
    weights: SourceWeights,
    assignment: SchemeAssignment,
    work: WorkDir,
    calibration: CalibrationSet | None,
    records: list[LayerRecord],
    storage: torch.dtype,
) -> None:
    from safetensors import safe_open

    model_config = config_json(source)
    model_config.pop("quantization_config", None)
    quantization_config = assignment.quantization_config()
    layer_prefix = arch.layers_path + "."
    copy_files = [
        f
        for f in sorted(source.iterdir())
        if f.is_file()
        and f.name not in _NOT_COPIED
        and not f.name.startswith(".")
        and not f.name.endswith(_WEIGHT_SUFFIXES)
    ]
    with ShardedWriter(Path(config.output), max_shard_bytes=config.max_shard_bytes, overwrite=config.force) as writer:
        for name in weights.names():
            if not name.startswith(layer_prefix):
                writer.add({name: weights.get(name)})
        for index in range(work.finished):
            with safe_open(str(work.block_file(index)), framework="pt") as f:
                writer.add({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 (safe_open API)
        log = {
            "method": config.method,
            "damp": config.damp,
            "block_size": config.block_size,
            "calibration": None if calibration is None else calibration.metadata,
            "calibration_shape": None if calibration is None else list(calibration.input_ids.shape),
            "fingerprints": work.state["fingerprints"],
            "layers": work.records,
        }
        (writer.tmp_dir / LOG_FILE).write_text(json.dumps(log, indent=1, sort_keys=True) + "\n")
        writer.finalize(model_config, copy_files, quantization_config)
