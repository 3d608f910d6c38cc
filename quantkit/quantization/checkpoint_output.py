"""From finished blocks to the checkpoint: each block's tensors (packed linears, the rest in the storage dtype),
then the whole directory (non-block tensors, the blocks from the work directory, config.json with its
``quantization_config``, the tokenizer files, ``quantkit_log.json`` with the coverage audit, and the model card
README.md), written atomically."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from quantkit.format.coverage import COVERAGE, audit_checkpoint
from quantkit.format.files import MODEL_CARD, RUN_LOG, side_files
from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.safetensors_stream import stored_tensors
from quantkit.format.scheme import QuantizedWeight
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter
from quantkit.model.source_weights import config_json
from quantkit.quantization.assignment import float_modules
from quantkit.quantization.coverage_intent import linear_intents
from quantkit.quantization.input_ranges import OBSERVER_NAMES
from quantkit.quantization.job import QuantizeJob
from quantkit.quantization.model_card import model_card
from quantkit.quantization.workdir import WorkDir


def block_tensors(
    block: nn.Module,
    prefix: str,
    quantized: dict[str, QuantizedWeight],
    storage: torch.dtype,
    extra: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one block, on the CPU whatever device solved it: quantized linears in their
    format, ``extra`` tensors as given (a KV cache's scales), everything else in the storage dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in block.state_dict().items():
        module_name = name.rpartition(".")[0]
        if module_name in quantized and name.endswith(".weight"):
            continue
        tensors[f"{prefix}.{name}"] = tensor.to(storage) if tensor.is_floating_point() else tensor.clone()
    for name, qw in quantized.items():
        tensors.update(linear_tensors(f"{prefix}.{name}", _on_cpu(qw), storage))  # packed on the CPU
    for name, tensor in (extra or {}).items():
        tensors[f"{prefix}.{name}"] = tensor.clone()
    return {name: tensor.cpu() for name, tensor in tensors.items()}


def _on_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with its tensors on the CPU (itself when they are there already)."""
    if qw.qweight.device.type == "cpu":
        return qw
    move = {
        "qweight": qw.qweight,
        "scale": qw.scale,
        "zero": qw.zero,
        "g_idx": qw.g_idx,
        "global_scale": qw.global_scale,
        "input_scale": qw.input_scale,
    }
    return replace(qw, **{k: None if v is None else v.cpu() for k, v in move.items()})


def write_checkpoint(job: QuantizeJob, work: WorkDir) -> None:
    """The checkpoint directory at ``job.output`` from the source's other tensors and the finished blocks."""
    model_config = config_json(job.source)
    model_config.pop("quantization_config", None)
    layer_prefix = job.arch.layers_path + "."
    outer = work.load_outer()  # e.g. rotated: the embedding, final norm and an untied head
    outer_schemes = {}  # modules outside the blocks written quantized (a quantized head)
    for step in job.steps:  # e.g. a refitted head, then a quantized one
        outer |= step.hooks.final_tensors(step.config, job, work, outer)
        outer_schemes |= step.hooks.outer_schemes(step.config, job)
    if outer:
        model_config["tie_word_embeddings"] = False
    writer = ShardedWriter(job.output, max_shard_bytes=job.config.max_shard_bytes, overwrite=job.config.force)
    with writer:
        # tensors already in files (the source's, the finished blocks') are copied as stored, never loaded
        for name in job.weights.names():
            if not name.startswith(layer_prefix) and name not in outer:
                writer.add({name: job.weights.stored(name)})
        for name, tensor in outer.items():
            if tensor is not None:  # None: written in another form (a head's float weight, written packed)
                writer.add({name: tensor})
        for index in range(work.finished):
            writer.add(stored_tensors(work.block_file(index)))
        writer.finalize(
            model_config,
            side_files(job.source),
            job.assignment.quantization_config(
                float_modules(job.arch, job.num_layers),
                kv_cache=job.config.kv_cache,
                activation_observer=OBSERVER_NAMES[job.config.activation_observer],
                outer=outer_schemes,
            ),
            describe=lambda staged: describe_checkpoint(job, work, staged),
        )


def describe_checkpoint(job: QuantizeJob, work: WorkDir, staged: Path) -> None:
    """The files that describe the staged checkpoint, read back from its shards before it is renamed into place:
    ``quantkit_log.json`` with the coverage audit, then the model card (which reads the log)."""
    intents = linear_intents(job.assignment, work.layer_records, planned=job.config.planned is not None)
    audit = audit_checkpoint(staged, intents)
    log = _run_log(job, work) | {COVERAGE: audit.to_dict()}
    (staged / RUN_LOG).write_text(json.dumps(log, indent=1, sort_keys=True) + "\n")
    (staged / MODEL_CARD).write_text(model_card(job, log, audit, inspect_checkpoint(staged)))


def _run_log(job: QuantizeJob, work: WorkDir) -> dict:
    """The checkpoint's ``quantkit_log.json``: the method, every algorithm with every option, the data, the
    fingerprints, what each linear's solve recorded, and what each algorithm adds."""
    calibration = job.calibration
    log = {
        "method": job.config.method,
        "solvers": {entry.pop("name"): entry for entry in job.steps.canonical()},
        "calibration": None if calibration is None else calibration.metadata,
        "calibration_shape": None if calibration is None else list(calibration.input_ids.shape),
        "fingerprints": work.state["fingerprints"],
        "layers": [record.to_dict() for record in work.records],
    }
    for step in job.steps:
        log |= step.hooks.log(step.config, job.states.get(step.name))
    if job.device.type != "cpu":  # CPU runs keep the log they always had
        log["device"] = str(job.device)
    if job.assignment.fallbacks:
        log["layout_fallbacks"] = job.assignment.fallbacks  # --layout-policy fallback: linear -> "g128 -> g64"
    if job.arch.moe is not None and calibration is not None:  # the expert records' routed_tokens say how it went
        log["moe_calibration"] = job.config.moe_calibration
    return log


def read_run_fingerprints(output: Path) -> dict[str, str] | None:
    """The fingerprints a finished checkpoint recorded, or None when it is not a complete quantkit checkpoint."""
    log = output / RUN_LOG
    if not log.is_file() or not any(output.glob("*.safetensors")):
        return None
    try:
        return dict(json.loads(log.read_text()).get("fingerprints") or {})
    except (json.JSONDecodeError, AttributeError):
        return None
