"""One quantization run, resolved once before the block loop: where the weights come from and go, the
architecture, the calibration windows, the scheme of every linear, each algorithm's job-wide state, and the
fingerprints that guard ``--resume``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.data.calibration import CalibrationSet
from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import ArchSpec
from quantkit.model.precision import DEFAULT_COMPUTE_DTYPE, compute_dtype
from quantkit.model.source_weights import SourceWeights, config_json
from quantkit.quantization.assignment import (
    SchemeAssignment,
    check_exports,
    fit_expert_layouts,
    fit_layouts,
    uniform_assignment,
)
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import JobSteps
from quantkit.quantization.scheme_checks import check_float_layouts, check_kv_cache

NO_CALIBRATION = "none"
# Bumped when what the fingerprint hashes changes meaning, so that a work directory of an older quantkit is not
# resumed as if it were this run's. 4: Hessians summed in a fixed tree over chunks of mini-batches (the same bits
# for any number of processes), so blocks solved under the older running sum are not mixed into a run. 5: the float
# targets' moments summed in the same tree, and the MSE observer's sample of down_proj's inputs fixed (it held the
# last batch's rows only on CPU).
FINGERPRINT_FORMAT = 5


@dataclass(slots=True)
class QuantizeJob:
    model: str  # the model argument as given (alias, directory or hub id)
    config: QuantizeConfig
    source: Path  # the float model's directory
    output: Path
    arch: ArchSpec
    num_layers: int
    weights: SourceWeights
    storage: torch.dtype  # the float weights' dtype: unquantized tensors and scales are stored in it
    assignment: SchemeAssignment
    calibration: CalibrationSet | None  # None: data-free (round-to-nearest)
    steps: JobSteps = field(default_factory=lambda: JobSteps([]))
    states: dict[str, Any] = field(default_factory=dict)  # algorithm name -> what its prepare hook returned
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # config.device, resolved

    @property
    def unties_head(self) -> bool:
        return self.steps.any_cap("unties_head")

    @property
    def calibration_ids(self) -> torch.Tensor | None:
        return None if self.calibration is None else self.calibration.input_ids

    @property
    def forward_dtype(self) -> torch.dtype:
        return compute_dtype(self.config.compute_dtype)

    @property
    def residual_basis(self) -> torch.Tensor | None:
        """The rotation folded into the residual stream (from the rotation's prepared state), else None."""
        for step in self.steps:
            basis = step.hooks.residual_basis(self.states.get(step.name))
            if basis is not None:
                return basis
        return None

    def fingerprints(self) -> dict[str, str]:
        """What the output depends on, recorded in the work directory and the checkpoint's log."""
        return run_fingerprints(self.config, self.assignment, self.weights.fingerprint(), self.calibration)


def scheme_assignment(config: QuantizeConfig, arch: ArchSpec, weights: SourceWeights) -> SchemeAssignment:
    """The scheme of every block linear: the plan's (solved with the run's options) or one scheme for all, each
    layer's layout fitted to what engines load under ``config.layout_policy`` (shapes from the shard headers)."""
    planned = config.planned_schemes()
    if planned is not None:
        assignment = SchemeAssignment(planned)
    else:
        assignment = uniform_assignment(arch, num_layers_of(weights.path), config.resolved_scheme(), config.ignore)
    in_features = weights.in_features(list(assignment.schemes))
    # before the layout policy: a float format's group is its own, and no policy may change it
    check_float_layouts(assignment.schemes, in_features)
    check_kv_cache(config, str(config_json(weights.path).get("model_type", "")))
    assignment = fit_layouts(assignment, in_features, config.layout_policy)
    assignment = fit_expert_layouts(assignment, arch, weights, num_layers_of(weights.path), config.layout_policy)
    check_exports(assignment, in_features, config.export_formats, weights.storage_dtype())
    return assignment


def num_layers_of(source: Path) -> int:
    return int(config_json(source)["num_hidden_layers"])


def run_fingerprints(
    config: QuantizeConfig, assignment: SchemeAssignment, weights: str, calibration: CalibrationSet | None
) -> dict[str, str]:
    """Fingerprints of the weights, the calibration windows and everything that decides the solve."""
    return {
        "model": weights,
        "calibration data": NO_CALIBRATION if calibration is None else calibration.fingerprint(),
        "scheme": solve_fingerprint(config, assignment),
    }


def solve_fingerprint(config: QuantizeConfig, assignment: SchemeAssignment) -> str:
    """A hash of everything that decides the solved weights: every algorithm with every option (the job's
    canonical list), each linear's scheme, the mini-batch size (it orders the sums), how static input scales are
    calibrated, the KV cache scheme and the forward passes' precision."""
    spec = {
        "format": FINGERPRINT_FORMAT,
        "solvers": config.steps.canonical(),
        "schemes": {name: (_scheme_spec(s) if s else None) for name, s in assignment.schemes.items()},
        "batch_size": config.batch_size,
        "activation_observer": config.activation_observer,
        "kv_cache": config.kv_cache_scheme,
    }
    if config.moe_calibration != "all":  # the default leaves every fingerprint as it was before the option
        spec["moe_calibration"] = config.moe_calibration
    if config.compute_dtype != DEFAULT_COMPUTE_DTYPE:  # the same: the default adds nothing
        spec["compute_dtype"] = config.compute_dtype
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _scheme_spec(scheme: QuantScheme) -> dict[str, object]:
    """A scheme's fields; ``unpacked`` only when set, so that every packed scheme hashes as before the field."""
    spec = asdict(scheme)
    if not scheme.unpacked:
        del spec["unpacked"]
    return spec
