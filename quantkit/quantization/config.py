"""The configuration of one quantization job; the model and the output directory are the call's arguments.

A job is a scheme and a list of algorithm configs (``solvers``: a rotation's, GPTQ's and tuning's, say), each
config's defaults quantkit's own (``quantkit/quantization/methods/``, one module per algorithm). The CLI options,
the recipe schema, the fingerprint and the run log are derived from these dataclasses
(:mod:`quantkit.quantization.options`, :mod:`quantkit.recipes.solver_sections`, :mod:`quantkit.quantization.job`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.data.calibration import CalibrationConfig
from quantkit.device import DEFAULT_DEVICE, DEVICE_HELP, resolve_device
from quantkit.errors import QuantkitError
from quantkit.format.engines import EXPORT_SUPPORT, FALLBACK, LAYOUT_POLICIES, LAYOUT_POLICY_HELP
from quantkit.format.scheme import KVCacheScheme, QuantScheme
from quantkit.model.precision import COMPUTE_DTYPE_HELP, DEFAULT_COMPUTE_DTYPE, check_compute_dtype_name
from quantkit.model.staged_moe import MOE_CALIBRATION_MODES
from quantkit.quantization.input_ranges import OBSERVERS
from quantkit.quantization.methods.composition import (
    DEFAULT_METHOD,
    JobSteps,
    parse_method,
    resolve_scheme,
    with_method,
    with_solver_options,
)
from quantkit.quantization.methods.registry import option
from quantkit.quantization.scheme_checks import check_calibration

KV_CACHE_NAMES = {"fp8": "tensor", "fp8-head": "attn_head"}  # --kv-cache-scheme -> compressed-tensors strategy


@dataclass
class QuantizeConfig:
    """One job: the algorithms (``solvers``), the scheme, the data, and where and how the output is written.

    ``scheme`` None is the method's default scheme; ``planned`` (full linear name -> storage scheme, None for a
    linear kept in float) replaces the one scheme with a plan's, each solved with ``scheme``'s solver options
    (act-order, MSE clipping). The caller turns a plan file into ``planned``.
    """

    solvers: list[Any] = field(default_factory=lambda: parse_method(DEFAULT_METHOD))
    scheme: QuantScheme | None = None
    # None: no calibration data (the API's data-free job); a job that calibrates anything then fails up front
    calibration: CalibrationConfig | None = field(default_factory=CalibrationConfig)
    calibration_file: Path | None = None  # from `quantkit calibrate`; None: windows as `calibration` says
    ignore: list[str] = option([], "Regex of linears to keep in float (repeatable); lm_head always is.")
    planned: dict[str, QuantScheme | None] | None = None
    # the default writes a checkpoint every engine loads: a group size that does not divide a layer's in-features
    # becomes the largest that does on that layer (said in one line), instead of stopping the run
    layout_policy: str = option(FALLBACK, LAYOUT_POLICY_HELP)
    export_formats: list[str] = field(default_factory=list)  # exported afterwards by the caller: checked up front
    kv_cache_scheme: str | None = option(
        None,
        "An FP8 KV cache with scales calibrated on the calibration windows: fp8 (one key and one value scale per "
        "layer) or fp8-head (one per KV head); written as the checkpoint's kv_cache_scheme.",
    )
    activation_observer: str = option(
        "minmax",
        "How static input scales (FP8, NVFP4's global input scale) are calibrated: minmax (the largest input "
        "magnitude) or mse (the clipped range with the lowest quantization error).",
    )
    moe_calibration: str = option(
        "all",
        "Mixture-of-experts models: all (every calibration token runs through every expert for its statistics, "
        "only the routed outputs go forward) or routed (each expert sees only the tokens routed to it; an expert "
        "none reaches is solved by round-to-nearest).",
    )
    resume: bool = option(False, "Continue an interrupted run after its last finished block.")
    force: bool = option(False, "Replace an existing output directory (once the new one is done).")
    batch_size: int = option(4, "Calibration windows per forward pass.")
    compute_dtype: str = option(DEFAULT_COMPUTE_DTYPE, COMPUTE_DTYPE_HELP)
    max_shard_mb: int = option(1024, "Largest checkpoint shard, in MB (held in memory).", flag="--max-shard-size")
    device: str = option(DEFAULT_DEVICE, DEVICE_HELP)  # where blocks are solved
    show_progress: bool = True

    @classmethod
    def for_method(cls, method: str = DEFAULT_METHOD, *overrides: Any, **fields: Any) -> QuantizeConfig:
        """The job of a method spelling (``awq+gptq``); ``overrides`` replace its algorithms' default configs or
        add others (tuning, a rotation)."""
        return cls(solvers=with_method(method, *overrides), **fields)

    @classmethod
    def of(cls, config: QuantizeConfig | Any | Sequence[Any] | str | None) -> QuantizeConfig:
        """A job config from what a caller may pass: a job config, a method spelling, one algorithm config or a
        list of them (AWQ's and GPTQ's, say), or None (the default method)."""
        if isinstance(config, QuantizeConfig):
            return config
        if config is None or isinstance(config, str):
            return cls.for_method(config or DEFAULT_METHOD)
        solvers = list(config) if isinstance(config, Sequence) else [config]
        JobSteps(solvers)  # checked now: one weight solver, what each algorithm requires
        return cls(solvers=solvers)

    @property
    def steps(self) -> JobSteps:
        """The algorithms that act, checked and in run order."""
        return JobSteps(self.solvers)

    @property
    def method(self) -> str:
        return self.steps.method

    @property
    def needs_calibration(self) -> bool:
        """Whether the job runs on calibration windows: an algorithm that reads activations, a static input scale
        or a KV cache scale to calibrate."""
        return self.steps.needs_calibration or self.kv_cache is not None or self.static_inputs

    @property
    def kv_cache(self) -> KVCacheScheme | None:
        if self.kv_cache_scheme is None:
            return None
        strategy = KV_CACHE_NAMES.get(self.kv_cache_scheme)
        if strategy is None:
            raise QuantkitError(
                f"unknown KV cache scheme '{self.kv_cache_scheme}'; use one of {', '.join(KV_CACHE_NAMES)}"
            )
        return KVCacheScheme(strategy=strategy)

    @property
    def static_inputs(self) -> bool:
        """Whether some linear's input scheme stores a calibrated scale."""
        schemes = [self.resolved_scheme()] if self.planned is None else list(self.planned.values())
        return any(s is not None and s.activations is not None and s.activations.static_scale for s in schemes)

    @property
    def max_shard_bytes(self) -> int:
        return self.max_shard_mb * 1_000_000

    def resolved_scheme(self) -> QuantScheme:
        return self.scheme if self.scheme is not None else resolve_scheme(self.steps.scheme_defaults())

    def planned_schemes(self) -> dict[str, QuantScheme | None] | None:
        """The plan's schemes solved with this run's solver options (None without a plan)."""
        if self.planned is None:
            return None
        options = self.resolved_scheme()
        return {name: None if s is None else with_solver_options(s, options) for name, s in self.planned.items()}

    def validate(self) -> None:
        self.steps  # noqa: B018 (checks the algorithms)
        if self.batch_size < 1:
            raise QuantkitError(f"--batch-size must be positive, got {self.batch_size}")
        check_compute_dtype_name(self.compute_dtype)  # an unknown name is refused with the choices
        if self.layout_policy not in LAYOUT_POLICIES:
            raise QuantkitError(
                f"unknown layout policy '{self.layout_policy}'; use one of {', '.join(LAYOUT_POLICIES)}"
            )
        unknown = [f for f in self.export_formats if f not in EXPORT_SUPPORT]
        if unknown:
            raise QuantkitError(f"unknown export format '{unknown[0]}'; use {', '.join(EXPORT_SUPPORT)}")
        if self.max_shard_mb < 1:
            raise QuantkitError(f"--max-shard-size must be at least 1 MB, got {self.max_shard_mb}")
        for pattern in self.ignore:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise QuantkitError(f"--ignore '{pattern}' is not a valid regular expression: {exc}") from exc
        self.kv_cache  # noqa: B018 (checks the name)
        if self.activation_observer not in OBSERVERS:
            raise QuantkitError(
                f"unknown activation observer '{self.activation_observer}'; use one of {', '.join(OBSERVERS)}"
            )
        if self.moe_calibration not in MOE_CALIBRATION_MODES:
            raise QuantkitError(
                f"unknown --moe-calibration '{self.moe_calibration}'; use one of {', '.join(MOE_CALIBRATION_MODES)}"
            )
        check_calibration(self)  # calibration=None: nothing the job calibrates (static scales, a KV cache)
        if self.calibration_file is None and self.calibration is not None:
            self.calibration.validate()
        resolve_device(self.device)  # an unknown or unavailable device fails before any work
