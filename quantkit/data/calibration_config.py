"""Configuration dataclasses: each CLI command builds one and calls one library function."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError

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
