"""Configuration dataclasses: each CLI command builds one and calls one library function."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.awq import AWQConfig
from quantkit.errors import QuantkitError
from quantkit.scheme import QuantScheme

STRATEGIES = ("random", "document")
SELECTIONS = ("random", "diverse")


@dataclass(slots=True)
class CalibrationConfig:
    model: str = "smollm2-135m"
    dataset: str | None = None  # None: the shipped calibration corpus
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    strategy: str = "random"  # random windows over the joined text, or one window per document
    min_length: int | None = None  # document strategy: minimum document length in tokens (default seq_len)
    select: str = "random"  # or "diverse": TF-IDF + MiniBatchKMeans coverage of the text
    text_column: str = "text"
    output: Path | None = None
    show_progress: bool = True

    def validate(self) -> None:
        if self.num_samples < 1:
            raise QuantkitError(f"--num-samples must be at least 1, got {self.num_samples}")
        if self.seq_len < 2:
            raise QuantkitError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.strategy not in STRATEGIES:
            raise QuantkitError(f"unknown strategy '{self.strategy}'; use one of {', '.join(STRATEGIES)}")
        if self.select not in SELECTIONS:
            raise QuantkitError(f"unknown selection '{self.select}'; use one of {', '.join(SELECTIONS)}")
        if self.min_length is not None and self.min_length < 1:
            raise QuantkitError(f"--min-length must be positive, got {self.min_length}")


@dataclass(slots=True)
class EvalConfig:
    model: str = "smollm2-135m"
    dataset: str | None = None  # None: the shipped held-out evaluation text
    seq_len: int = 512
    max_windows: int | None = None
    stride: int | None = None  # None: non-overlapping windows
    reference: str | None = None
    text_column: str = "text"
    batch_size: int = 4
    json_path: Path | None = None
    show_progress: bool = True

    def validate(self) -> None:
        if self.seq_len < 2:
            raise QuantkitError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.max_windows is not None and self.max_windows < 1:
            raise QuantkitError(f"--max-windows must be at least 1, got {self.max_windows}")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            raise QuantkitError(f"--stride must be between 1 and --seq-len ({self.seq_len}), got {self.stride}")
        if self.batch_size < 1:
            raise QuantkitError(f"--batch-size must be at least 1, got {self.batch_size}")


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
