"""Per-layer sensitivity: the error of every quantizable unit under every candidate scheme, after the real solver.

A unit is what gets one scheme: a fused group (q/k/v, gate/up) or a single linear. Inputs are the float
model's (each unit is measured alone). Modes:
- ``proxy``: the Hessian-weighted output error tr(dW H dW^T) summed over the unit's linears (GPTQ's own
  objective, from statistics the pass collects anyway);
- ``kl``: mean KL divergence of the final next-token distribution from the float model's when only that
  unit is quantized, on a few calibration windows (slower; the whole float model is held in memory);
- ``hybrid``: the proxy errors of each unit, rescaled so that its lowest-bit candidate's error equals that
  candidate's measured KL. The proxy ranks a unit's candidates well (same Hessian) but is not comparable
  across layers (activation scales and downstream gain differ); one KL forward per unit makes it so.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.eval.logit_metrics import token_kl
from quantkit.format.scheme import QuantScheme
from quantkit.mixed.candidates import parse_candidate, unit_storage_bits
from quantkit.mixed.measurement import MODES, CandidateCost, Measurement, UnitMeasurement, save_measurement
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner, embed, get_module
from quantkit.model.source_weights import SourceWeights, build_skeleton, load_module, release_module
from quantkit.progress import progress_bar
from quantkit.quantize.memory import release_freed_memory
from quantkit.quantize.methods import with_solver_options
from quantkit.quantize.solvers.gptq import GPTQConfig, gptq_solve, hessian_weighted_error
from quantkit.quantize.spill import SpillFile
from quantkit.quantize.staged_block import StagedBlock
from quantkit.quantize.statistics import HessianStat

DEFAULT_CANDIDATES = ("int4-g128", "int4-g64", "int4-g32", "int8", "fp16")


@dataclass(slots=True)
class SensitivityConfig:
    model: str
    output: Path | None = None
    calib: Path | None = None
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    mode: str = "proxy"
    damp: float = 0.01
    block_size: int = 128
    batch_size: int = 4
    kl_windows: int = 2
    act_order: bool = True  # solve candidates as `quantize` will (static groups: storage cost unchanged)
    mse_clip: bool = True
    show_progress: bool = True

    def validate(self) -> None:
        if self.mode not in MODES:
            raise QuantkitError(f"unknown mode '{self.mode}'; use one of {', '.join(MODES)}")
        if not self.candidates:
            raise QuantkitError("--candidates is empty; list at least one, e.g. int4-g128,int8,fp16")
        for name in self.candidates:
            parse_candidate(name)
        if self.kl_windows < 1:
            raise QuantkitError(f"--kl-windows must be at least 1, got {self.kl_windows}")


@dataclass(slots=True)
class _KLState:
    """The float model's logits on a few windows, and each block's input for them."""

    model: nn.Module
    reference: torch.Tensor  # [w, T, V] float32 logits
    hidden: torch.Tensor  # [w, T, H] float32 input of the current block


def unit_name(prefix: str, linears: tuple[str, ...]) -> str:
    if len(linears) == 1:
        return f"{prefix}.{linears[0]}"
    parent = linears[0].rpartition(".")[0]
    return f"{prefix}.{parent}." + "+".join(name.rpartition(".")[2] for name in linears)


def measure_sensitivity(config: SensitivityConfig) -> Measurement:
    """Measure every unit under every candidate; save to ``config.output`` when set."""
    from quantkit.model.resolve import arch_for_dir, load_model, load_tokenizer, resolve_model
    from quantkit.quantize.pipeline import calibration_for_model

    config.validate()
    start = time.perf_counter()
    source = resolve_model(config.model)
    arch = arch_for_dir(source)
    calibration = calibration_for_model(
        config.model,
        config.calib,
        load_tokenizer(source),
        config.num_samples,
        config.seq_len,
        config.seed,
        config.show_progress,
    )
    options = QuantScheme(act_order=config.act_order, static_groups=True, mse_clip=config.mse_clip)
    schemes = {name: parse_candidate(name) for name in config.candidates}
    solved_as = {name: None if s is None else with_solver_options(s, options) for name, s in schemes.items()}
    gptq = GPTQConfig(damp=config.damp, block_size=config.block_size)
    units: list[UnitMeasurement] = []
    scratch_parent = None if config.output is None else config.output.resolve().parent
    if scratch_parent is not None and not scratch_parent.is_dir():
        scratch_parent = None  # the system's temporary directory
    with (
        SourceWeights(source) as weights,
        tempfile.TemporaryDirectory(dir=scratch_parent) as scratch,
        SpillFile(Path(scratch) / "down_inputs.spill") as spill,  # see StagedBlock: spares the output the MLP
    ):
        storage = weights.storage_dtype()
        if config.mode != "proxy":
            model = load_model(source)
            kl = _kl_state(model, arch, calibration.input_ids[: config.kl_windows])
        else:
            model, kl = build_skeleton(source), None
        runner = BlockRunner.for_model(model, arch, calibration.seq_len, config.batch_size)
        hidden = _embed_calibration(model, arch, weights, calibration.input_ids, storage, lazy=kl is None)
        layers = get_module(model, arch.layers_path)
        with progress_bar(config.show_progress) as bar:
            task = bar.add_task(f"Measuring ({config.mode})", total=len(layers))
            for index, block in enumerate(layers):
                prefix = f"{arch.layers_path}.{index}"
                if kl is None:
                    load_module(block, prefix, weights)
                staged = StagedBlock(block, arch, runner, hidden, spill=spill)
                for stage_index, stage in enumerate(arch.sequential_stages):
                    hessian = HessianStat.zeros(get_module(block, stage[0]).in_features)
                    for x in staged.stage_inputs(stage_index):
                        hessian.update(x)
                    units.append(
                        _measure_unit(
                            block,
                            prefix,
                            stage,
                            hessian.hessian(),
                            solved_as,
                            gptq,
                            storage,
                            kl,
                            index,
                            arch,
                            config.mode,
                        )
                    )
                hidden = staged.output()
                if kl is not None:
                    kl.hidden = runner.run(block, kl.hidden)
                else:
                    release_module(block)
                release_freed_memory()
                bar.advance(task)
    measurement = Measurement(
        model=config.model,
        mode=config.mode,
        candidates=list(config.candidates),
        units=units,
        metadata={
            "calibration_hash": hashlib.sha256(calibration.input_ids.numpy().tobytes()).hexdigest()[:16],
            "calibration_shape": list(calibration.input_ids.shape),
            "solver": "gptq",
            "damp": config.damp,
            "act_order": config.act_order,
            "mse_clip": config.mse_clip,
            "kl_windows": config.kl_windows if config.mode != "proxy" else None,
            "seconds": round(time.perf_counter() - start, 1),
        },
    )
    if config.output is not None:
        save_measurement(measurement, config.output)
    return measurement


def _embed_calibration(model, arch, weights, ids, storage, *, lazy: bool) -> torch.Tensor:
    embedding = get_module(model, arch.embed_path)
    if lazy:
        load_module(embedding, arch.embed_path, weights, dtype=storage)
    hidden = embed(model, arch, ids, storage)
    if lazy:
        release_module(embedding)
    return hidden


def _kl_state(model: nn.Module, arch: ArchSpec, ids: torch.Tensor) -> _KLState:
    with torch.inference_mode():
        reference = model(input_ids=ids, use_cache=False).logits.float()
    return _KLState(model, reference, embed(model, arch, ids, torch.float32))


def _measure_unit(
    block: nn.Module,
    prefix: str,
    linears: tuple[str, ...],
    hessian: torch.Tensor,
    schemes: dict,
    gptq: GPTQConfig,
    storage: torch.dtype,
    kl: _KLState | None,
    index: int,
    arch: ArchSpec,
    mode: str,
) -> UnitMeasurement:
    modules = [get_module(block, name) for name in linears]
    shapes = [(m.out_features, m.in_features) for m in modules]
    options = {
        name: CandidateCost(error=0.0, bits=unit_storage_bits(scheme, shapes, scale_bits=storage.itemsize * 8))
        for name, scheme in schemes.items()  # scales are stored in the storage dtype
    }
    quantized = [name for name, scheme in schemes.items() if scheme is not None]
    anchor = min(quantized, key=lambda name: options[name].bits) if mode == "hybrid" and quantized else None
    kl_scale = 1.0
    for candidate in quantized:
        solved = [
            gptq_solve(
                m.weight.data, hessian, schemes[candidate], gptq, scale_dtype=storage, name=f"{prefix}.{n}"
            ).weight.dequantize()
            for m, n in zip(modules, linears, strict=True)
        ]
        if mode == "kl":
            options[candidate].error = _kl_with(modules, solved, kl, index, arch)
            continue
        pairs = zip(modules, solved, strict=True)
        proxy = float(sum(hessian_weighted_error(m.weight.data, w, hessian) for m, w in pairs))
        options[candidate].error = proxy
        if candidate == anchor:
            kl_scale = _kl_with(modules, solved, kl, index, arch) / proxy if proxy > 0 else 0.0
    for candidate in quantized:
        options[candidate].error *= kl_scale
    params = sum(n * k for n, k in shapes)
    return UnitMeasurement(
        name=unit_name(prefix, linears), modules=[f"{prefix}.{n}" for n in linears], params=params, options=options
    )


def _kl_with(modules: list[nn.Module], weights: list[torch.Tensor], kl: _KLState, index: int, arch: ArchSpec) -> float:
    """Mean KL of the final distribution with ``modules`` temporarily holding ``weights``."""
    originals = [m.weight.data for m in modules]
    layers = get_module(kl.model, arch.layers_path)
    seq_len = kl.hidden.shape[1]
    runner = BlockRunner.for_model(kl.model, arch, seq_len, batch_size=kl.hidden.shape[0])
    try:
        for m, w in zip(modules, weights, strict=True):
            m.weight.data = w
        with torch.inference_mode():
            hidden = kl.hidden
            for layer in list(layers)[index:]:
                hidden = runner(layer, hidden)
            logits = get_module(kl.model, arch.lm_head_path)(get_module(kl.model, arch.final_norm_path)(hidden))
        return float(token_kl(kl.reference, logits.float()).mean())
    finally:
        for m, w in zip(modules, originals, strict=True):
            m.weight.data = w
