"""Per-layer sensitivity: the error of every quantizable unit under every candidate scheme, after the real solver.

A unit is what gets one scheme: a fused group (q/k/v, gate/up) or a single linear. Inputs are the float
model's (each unit is measured alone). Modes:
- ``proxy``: the Hessian-weighted output error tr(dW H dW^T) summed over the unit's linears (GPTQ's own
  objective, from statistics the pass collects anyway);
- ``kl``: mean KL divergence of the final next-token distribution from the float model's when only that
  unit is quantized, on a few calibration windows (slower; the whole float model is held in memory);
- ``hybrid`` (the default, :data:`~quantkit.mixed.measurement.DEFAULT_MODE`): the proxy errors of each unit,
  rescaled so that its lowest-bit candidate's error equals that candidate's measured KL. The proxy ranks a
  unit's candidates well (same Hessian) but is not comparable across layers (activation scales and downstream
  gain differ); one KL forward per unit makes it so.

``rotation`` (``--rotate hadamard``): the units are measured on the model as a ``quantize --rotate hadamard`` run
holds it, with the same rotation folded into every block, the embedding and the (then untied) head, so that a plan
for a rotated run is priced on the weights that run solves (a rotation moves sensitivity between layers: it spreads
the outlier channels that make the unrotated q/k/v and down_proj costly at 4 bits).

``proxy`` is the fast option (no full-model forward, the float model is never held whole); its plans rank a
layer's own candidates but lose to uniform schemes at low budgets, since its errors do not compare across layers
(the sweep is in docs/benchmarks.md, "Mixed precision").
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.data.calibration import CalibrationConfig
from quantkit.data.model_calibration import calibration_for_model
from quantkit.device import resolve_device
from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.mixed.candidates import DEFAULT_CANDIDATES, parse_candidate
from quantkit.mixed.expert_units import is_expert_unit_stage, merge_expert_units
from quantkit.mixed.measurement import (
    DEFAULT_MODE,
    MODES,
    ROTATION_KEY,
    Measurement,
    UnitMeasurement,
    save_measurement,
)
from quantkit.mixed.outer_units import DEFAULT_OUTER, SOLVERS, check_outer_candidates, measure_outer
from quantkit.mixed.unit_error import KLReference, UnitMeter
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner, embed
from quantkit.model.source_weights import SourceWeights, build_skeleton, config_json
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.block_loop import embed_inputs, stage_hessians, walk_blocks
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods import registry
from quantkit.quantization.methods.composition import JobSteps, parse_method, with_solver_options
from quantkit.quantization.methods.rotation import OFF as ROTATION_OFF
from quantkit.quantization.methods.rotation import RotationConfig, job_rotation, rotate_loaded_model
from quantkit.quantization.solvers.gptq import GPTQSettings
from quantkit.quantization.spill import SpillFile

SOLVER = "gptq"  # candidates are solved as `quantize --method gptq` solves them
_DEFAULTS = JobSteps(parse_method(SOLVER)).scheme_defaults()


@dataclass
class SensitivityConfig:
    """What to measure; the model and the output file are the call's arguments."""

    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    mode: str = DEFAULT_MODE  # hybrid | proxy (fast) | kl (see the module docstring)
    kl_windows: int = 2  # kl / hybrid: calibration windows the KL is measured on
    gptq: GPTQSettings = field(default_factory=lambda: parse_method(SOLVER)[0])  # the solver's options
    act_order: bool = _DEFAULTS["act_order"]  # with static groups: storage cost unchanged
    mse_clip: bool = _DEFAULTS["mse_clip"]
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    calibration_file: Path | None = None  # from `quantkit calibrate`; None: windows as `calibration` says
    batch_size: int = QuantizeConfig.batch_size
    device: str = QuantizeConfig.device  # where blocks, statistics, solves (and the kl/hybrid model) live
    show_progress: bool = True
    outer: bool = False  # also measure the head and the embedding as units (outer_units.py); kl/hybrid only
    outer_candidates: list[str] = field(default_factory=lambda: list(DEFAULT_OUTER))  # --quantize-head spellings
    rotation: RotationConfig | None = None  # fold this rotation first, as quantize does (None or kind none: no)

    @property
    def rotates(self) -> bool:
        return self.rotation is not None and self.rotation.kind != ROTATION_OFF

    def validate(self) -> None:
        if self.mode not in MODES:
            raise QuantkitError(f"unknown mode '{self.mode}'; use one of {', '.join(MODES)}")
        if not self.candidates:
            raise QuantkitError("--candidates is empty; list at least one, e.g. int4-g128,int8,fp16")
        for name in self.candidates:
            parse_candidate(name)
        if self.kl_windows < 1:
            raise QuantkitError(f"--kl-windows must be at least 1, got {self.kl_windows}")
        resolve_device(self.device)
        if self.outer:
            check_outer_candidates(self.outer_candidates)
            if self.mode == "proxy":
                raise QuantkitError(
                    "--outer measures the head and the embedding as final-logit KL, which --mode proxy does not "
                    "compute; use --mode hybrid (the default) or kl"
                )


def solver_options(configs: Sequence[Any]) -> GPTQSettings:
    """The sensitivity solver's options as a job holds them (its defaults when the job does not hold it)."""
    return next((c for c in configs if registry.of(c).name == SOLVER), parse_method(SOLVER)[0])


def measure_sensitivity(model: str | Path, config: SensitivityConfig, output: Path | None = None) -> Measurement:
    """Measure every unit of ``model`` under every candidate; saved to ``output`` when given."""
    from quantkit.model.resolve import arch_for_dir, load_model, load_tokenizer, resolve_model

    config.validate()
    start = time.perf_counter()
    source = resolve_model(model)
    arch = arch_for_dir(source)
    calibration = calibration_for_model(model, config.calibration, config.calibration_file, load_tokenizer(source))
    options = QuantScheme(act_order=config.act_order, static_groups=True, mse_clip=config.mse_clip)
    schemes = {name: parse_candidate(name) for name in config.candidates}
    solved_as = {name: None if s is None else with_solver_options(s, options) for name, s in schemes.items()}
    units: list[UnitMeasurement] = []
    device = resolve_device(config.device)
    with (
        SourceWeights(source) as weights,
        tempfile.TemporaryDirectory(dir=_scratch_parent(output)) as scratch,
        SpillFile(Path(scratch) / "down_inputs.spill") as spill,  # see StagedBlock: spares the output the MLP
    ):
        storage = weights.storage_dtype()
        rotation = job_rotation(config.rotation, source, arch, weights) if config.rotates else None
        outer_rotated = None if rotation is None else rotation.outer_tensors(weights)
        meter = UnitMeter(arch, solved_as, config.gptq, storage, config.mode)
        if config.mode != "proxy":  # the whole float model, for the final logits
            skeleton, lazy = load_model(source, device=device), None
            if rotation is not None:
                assert outer_rotated is not None
                rotate_loaded_model(skeleton, rotation, outer_rotated)
            meter.kl = _kl_reference(skeleton, arch, calibration.input_ids[: config.kl_windows].to(device))
        else:
            skeleton, lazy = build_skeleton(source), weights
        runner = BlockRunner.for_model(skeleton, arch, calibration.seq_len, config.batch_size, device=device)
        ids = calibration.input_ids.to(device) if lazy is None else calibration.input_ids  # where the embedding is
        if rotation is not None and lazy is not None:  # the blocks stream in: the first input from the rotated table
            assert outer_rotated is not None
            hidden = rotation.embed_inputs(outer_rotated, ids, storage).to(device)
        else:
            hidden = embed_inputs(skeleton, arch, lazy, ids, storage).to(device)
        visits = walk_blocks(
            skeleton,
            arch,
            lazy,
            description=f"Measuring ({config.mode})",
            device=device,
            show_progress=config.show_progress,
        )
        on_cpu = device.type == "cpu"  # the spill file spares CPU memory; on a GPU activations stay on it
        for visit in visits:
            if rotation is not None and lazy is not None:  # a streamed block: folded as quantize folds it
                rotation.fold(visit.module, visit.index)
            layer = arch.for_layer(visit.index)  # a hybrid model's layers have their own attention stages
            staged = StagedBlock(visit.module, layer, runner, hidden, spill=spill if on_cpu else None)
            experts = []  # an MoE block's MLP stages: one unit per layer (expert_units.py)
            for stage, hessian, _ in stage_hessians(staged):
                assert hessian is not None
                unit = meter.measure(visit.module, visit.prefix, visit.index, stage, hessian)
                (experts if is_expert_unit_stage(arch, stage.name) else units).append(unit)
            if experts:
                units.append(merge_expert_units(visit.prefix, arch, experts))
            hidden = staged.output()
            if meter.kl is not None:
                meter.kl.hidden = runner.run(visit.module, meter.kl.hidden)
        outer = []
        if config.outer:
            assert meter.kl is not None  # validate() refuses --outer in proxy mode
            eps = float(config_json(source).get("rms_norm_eps", 1e-6))
            kl_ids = calibration.input_ids[: config.kl_windows].to(device)
            outer = measure_outer(meter.kl, arch, kl_ids, hidden, config.outer_candidates, storage, eps)
    measurement = Measurement(
        model=str(model),
        mode=config.mode,
        candidates=list(config.candidates),
        units=units,
        metadata={
            "calibration_hash": calibration.fingerprint(),
            "calibration_shape": list(calibration.input_ids.shape),
            "solver": SOLVER,
            "damp": config.gptq.damp,
            "act_order": config.act_order,
            "mse_clip": config.mse_clip,
            "kl_windows": config.kl_windows if config.mode != "proxy" else None,
            "seconds": round(time.perf_counter() - start, 1),
        }
        | ({"outer_solvers": dict(SOLVERS)} if outer else {})
        | ({} if rotation is None else {ROTATION_KEY: rotation.log()}),
        outer=outer,
    )
    if output is not None:
        save_measurement(measurement, Path(output))
    return measurement


def _scratch_parent(output: Path | None) -> Path | None:
    """The spill file goes beside the output (the system's temporary directory when that does not exist)."""
    parent = None if output is None else Path(output).resolve().parent
    return parent if parent is not None and parent.is_dir() else None


def _kl_reference(model: nn.Module, arch: ArchSpec, ids: torch.Tensor) -> KLReference:
    with torch.inference_mode():
        reference = model(input_ids=ids, use_cache=False).logits.float()
    return KLReference(model, reference, embed(model, arch, ids, torch.float32))
