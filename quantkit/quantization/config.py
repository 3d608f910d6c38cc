"""The configuration of one quantization job; the model and the output directory are the call's arguments."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.data.calibration import CalibrationConfig
from quantkit.device import DEFAULT_DEVICE, resolve_device
from quantkit.errors import QuantkitError
from quantkit.format.engines import EXPORT_SUPPORT, LAYOUT_POLICIES, STRICT
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.methods import (
    SolverConfig,
    check_solvers,
    expand_method,
    method_name,
    needs_calibration,
    resolve_scheme,
    with_solver_options,
)
from quantkit.quantization.solvers.awq import AWQConfig
from quantkit.quantization.solvers.gptq import GPTQConfig
from quantkit.quantization.solvers.tune import TuneConfig
from quantkit.rotation.config import RotationConfig

DEFAULT_METHOD = "gptq"


@dataclass
class QuantizeConfig:
    """One job: the solvers (a method's list, see :mod:`quantkit.quantization.methods`), the scheme, the data.

    ``scheme`` None is the method's default scheme (:func:`resolve_scheme`); ``planned`` (full linear name ->
    storage scheme, None for a linear kept in float) replaces the one scheme with a plan's, each solved with
    ``scheme``'s solver options (act-order, MSE clipping). The caller turns a plan file into ``planned``.
    """

    solvers: list[SolverConfig] = field(default_factory=lambda: expand_method(DEFAULT_METHOD))
    scheme: QuantScheme | None = None
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    calibration_file: Path | None = None  # from `quantkit calibrate`; None: windows as `calibration` says
    rotation: RotationConfig = field(default_factory=RotationConfig)  # folded into the weights before solving
    tune: TuneConfig | None = None  # block-output tuning after the weight solver (None: off)
    refit_head: bool = False  # refit the float head to the quantized body (quantkit.quantization.head_refit)
    ignore: list[str] = field(default_factory=list)  # regexes (re.search) of linears kept in float
    planned: dict[str, QuantScheme | None] | None = None
    layout_policy: str = STRICT  # layouts engines would refuse: see quantkit.format.engines.LAYOUT_POLICIES
    export_formats: list[str] = field(default_factory=list)  # exported afterwards by the caller: checked up front
    resume: bool = False
    force: bool = False
    batch_size: int = 4  # calibration windows per forward pass
    max_shard_bytes: int = 1024 * 1_000_000  # largest checkpoint shard (held in memory while written)
    device: str = DEFAULT_DEVICE  # where blocks are solved (quantkit.device: auto, cpu, cuda, cuda:N)
    show_progress: bool = True

    @classmethod
    def for_method(cls, method: str = DEFAULT_METHOD, *overrides: SolverConfig, **fields: object) -> QuantizeConfig:
        """The job of a method spelling (``awq+gptq``); ``overrides`` replace its solvers' default configs."""
        return cls(solvers=expand_method(method, *overrides), **fields)  # type: ignore[arg-type]

    @classmethod
    def of(cls, config: QuantizeConfig | SolverConfig | Sequence[SolverConfig] | str | None) -> QuantizeConfig:
        """A job config from what a caller may pass: a job config, a method spelling, one solver config or a
        list of them (``[AWQConfig(), GPTQConfig()]``), or None (the default method)."""
        if isinstance(config, QuantizeConfig):
            return config
        if config is None or isinstance(config, str):
            return cls.for_method(config or DEFAULT_METHOD)
        solvers = list(config) if isinstance(config, Sequence) else [config]
        check_solvers(solvers)
        return cls(solvers=solvers)

    @property
    def method(self) -> str:
        return method_name(self.solvers)

    @property
    def gptq(self) -> GPTQConfig | None:
        return next((s for s in self.solvers if isinstance(s, GPTQConfig)), None)

    @property
    def awq(self) -> AWQConfig | None:
        return next((s for s in self.solvers if isinstance(s, AWQConfig)), None)

    @property
    def tuning(self) -> bool:
        return self.tune is not None and self.tune.steps > 0

    @property
    def needs_calibration(self) -> bool:
        return needs_calibration(self.solvers) or self.keeps_reference

    @property
    def keeps_reference(self) -> bool:
        """The run carries the float model's activations beside the quantized ones (tuning's targets, the head's
        refit, GPTQ's float targets)."""
        return self.tuning or self.refit_head or (self.gptq is not None and self.gptq.float_targets)

    def resolved_scheme(self) -> QuantScheme:
        return self.scheme if self.scheme is not None else resolve_scheme(self.method)

    def planned_schemes(self) -> dict[str, QuantScheme | None] | None:
        """The plan's schemes solved with this run's solver options (None without a plan)."""
        if self.planned is None:
            return None
        options = self.resolved_scheme()
        return {name: None if s is None else with_solver_options(s, options) for name, s in self.planned.items()}

    def validate(self) -> None:
        check_solvers(self.solvers)
        if self.batch_size < 1:
            raise QuantkitError(f"--batch-size must be positive, got {self.batch_size}")
        if self.layout_policy not in LAYOUT_POLICIES:
            raise QuantkitError(
                f"unknown layout policy '{self.layout_policy}'; use one of {', '.join(LAYOUT_POLICIES)}"
            )
        unknown = [f for f in self.export_formats if f not in EXPORT_SUPPORT]
        if unknown:
            raise QuantkitError(f"unknown export format '{unknown[0]}'; use {', '.join(EXPORT_SUPPORT)}")
        if self.max_shard_bytes < 1_000_000:
            raise QuantkitError(f"--max-shard-size must be at least 1 MB, got {self.max_shard_bytes} bytes")
        for pattern in self.ignore:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise QuantkitError(f"--ignore '{pattern}' is not a valid regular expression: {exc}") from exc
        if self.calibration_file is None:
            self.calibration.validate()
        resolve_device(self.device)  # an unknown or unavailable device fails before any work
