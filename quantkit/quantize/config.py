"""Configuration dataclasses: each CLI command builds one and calls one library function."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.data.calibration_config import CalibrationConfig
from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.solvers.awq import AWQConfig

METHODS = ("rtn", "gptq", "awq", "awq+gptq")


@dataclass(slots=True)
class QuantizeConfig:
    model: str
    output: Path
    method: str = "gptq"
    scheme: QuantScheme = field(default_factory=QuantScheme)
    damp: float = 0.01
    block_size: int = 128
    calib: Path | None = None  # None: windows from the shipped corpus
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    ignore: list[str] = field(default_factory=list)  # regexes (re.search) of linears kept in float
    plan: Path | None = None  # a mixed-precision plan (quantkit plan) instead of one scheme
    resume: bool = False
    force: bool = False
    batch_size: int = 4
    max_shard_bytes: int = 1 << 30
    awq: AWQConfig = field(default_factory=lambda: AWQConfig(search_samples=8, objective="linear"))
    show_progress: bool = True

    def validate(self) -> None:
        if self.method not in METHODS:
            raise QuantkitError(f"unknown method '{self.method}'; use one of {', '.join(METHODS)}")
        if not 0 <= self.damp < 1:
            raise QuantkitError(f"--damp must be in [0, 1), got {self.damp}")
        if self.block_size < 1:
            raise QuantkitError(f"--block-size must be positive, got {self.block_size}")
        if self.batch_size < 1:
            raise QuantkitError(f"--batch-size must be positive, got {self.batch_size}")
        if self.max_shard_bytes < 1_000_000:
            raise QuantkitError(f"--max-shard-size must be at least 1 MB, got {self.max_shard_bytes} bytes")
        for pattern in self.ignore:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise QuantkitError(f"--ignore '{pattern}' is not a valid regular expression: {exc}") from exc
        if self.calib is None:
            CalibrationConfig(num_samples=self.num_samples, seq_len=self.seq_len).validate()
