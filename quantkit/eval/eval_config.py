"""Configuration dataclasses: each CLI command builds one and calls one library function."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError


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
