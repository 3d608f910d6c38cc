"""Mergeable calibration statistics: running sums plus a row count, divided only at solve time.

Sums (not running means) make merging exact and order-independent: the stats of two shards merged equal
the stats of the concatenated data. Activations are never kept; only the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantkit.errors import CalibrationError, QuantkitError

_COUNT_KEY = "count"
_KIND_KEY = "kind"


def _rows(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """Flatten leading dims of ``x`` [..., K] into [rows, K]."""
    if x.ndim == 0 or x.shape[-1] != k:
        raise QuantkitError(f"{what}: expected inputs with last dim {k}, got shape {tuple(x.shape)}")
    return x.detach().reshape(-1, k)


def _check_mergeable(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise QuantkitError(f"cannot merge {what} of shapes {tuple(a.shape)} and {tuple(b.shape)}")


def _save(path: str | Path, tensors: dict[str, torch.Tensor], count: int, kind: str) -> None:
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(tensors, str(path), metadata={_COUNT_KEY: str(count), _KIND_KEY: kind})


def _load(path: str | Path, kind: str) -> tuple[dict[str, torch.Tensor], int]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get(_KIND_KEY) != kind or _COUNT_KEY not in meta:
        raise QuantkitError(f"{path} is not a saved {kind} statistic (metadata {meta})")
    return load_file(str(path)), int(meta[_COUNT_KEY])


def _divide_check(count: int, what: str) -> None:
    if count <= 0:
        raise CalibrationError(f"{what} has seen no calibration rows; run calibration before solving")


_GRAM_STRIPS = 4  # row strips of the upper triangle; ~(1 + 1/strips) / 2 of a full product's work


def add_gram_(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out += rows^T rows`` computing only the upper triangle (in strips) and mirroring it (in place).

    The Gram matrix is symmetric, so half the product is redundant: for the 1536-wide down_proj inputs of
    a small model this is the largest single cost of the calibration pass. The result is exactly symmetric.
    """
    k = rows.shape[1]
    strip = -(-k // _GRAM_STRIPS)
    if k < 256:  # small matrices: one full product is faster than several thin ones
        out.addmm_(rows.T, rows)
        return
    for i0 in range(0, k, strip):
        i1 = min(i0 + strip, k)
        upper = rows[:, i0:i1].T @ rows[:, i0:]  # [i1 - i0, k - i0]: the diagonal tile and everything right of it
        out[i0:i1, i0:] += upper
        out[i1:, i0:i1] += upper[:, i1 - i0 :].T


@dataclass(slots=True)
class HessianStat:
    """Sum of ``x^T x`` over calibration rows (``xtx`` [K, K]) and the number of rows ``count``."""

    xtx: torch.Tensor
    count: int = 0

    @classmethod
    def zeros(cls, k: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> HessianStat:
        return cls(torch.zeros(k, k, dtype=dtype, device=device), 0)

    @property
    def in_features(self) -> int:
        return int(self.xtx.shape[0])

    def update(self, x: torch.Tensor) -> None:
        """Accumulate ``x^T x`` for inputs ``x`` [..., K] in the stat's dtype."""
        rows = _rows(x, self.in_features, "HessianStat.update").to(device=self.xtx.device, dtype=self.xtx.dtype)
        add_gram_(self.xtx, rows)
        self.count += int(rows.shape[0])

    def merge(self, other: HessianStat) -> HessianStat:
        _check_mergeable(self.xtx, other.xtx, "Hessian statistics")
        dtype = torch.promote_types(self.xtx.dtype, other.xtx.dtype)
        xtx = self.xtx.to(dtype) + other.xtx.to(device=self.xtx.device, dtype=dtype)
        return HessianStat(xtx, self.count + other.count)

    def hessian(self) -> torch.Tensor:
        """float32 ``H = 2 / count * X^T X`` (divided in the accumulation dtype)."""
        _divide_check(self.count, "HessianStat")
        return (self.xtx * (2.0 / self.count)).float()

    def save(self, path: str | Path) -> None:
        _save(path, {"xtx": self.xtx}, self.count, "hessian")

    @classmethod
    def load(cls, path: str | Path) -> HessianStat:
        tensors, count = _load(path, "hessian")
        return cls(tensors["xtx"], count)


@dataclass(slots=True)
class ActStat:
    """Per-input-channel sum of ``|x|`` (``abs_sum`` [K]) and the number of rows ``count`` (for AWQ)."""

    abs_sum: torch.Tensor
    count: int = 0

    @classmethod
    def zeros(cls, k: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> ActStat:
        return cls(torch.zeros(k, dtype=dtype, device=device), 0)

    @property
    def in_features(self) -> int:
        return int(self.abs_sum.shape[0])

    def update(self, x: torch.Tensor) -> None:
        """Accumulate ``sum |x|`` per channel for inputs ``x`` [..., K]."""
        rows = _rows(x, self.in_features, "ActStat.update").to(device=self.abs_sum.device, dtype=self.abs_sum.dtype)
        self.abs_sum += rows.abs().sum(dim=0)
        self.count += int(rows.shape[0])

    def merge(self, other: ActStat) -> ActStat:
        _check_mergeable(self.abs_sum, other.abs_sum, "activation statistics")
        dtype = torch.promote_types(self.abs_sum.dtype, other.abs_sum.dtype)
        total = self.abs_sum.to(dtype) + other.abs_sum.to(device=self.abs_sum.device, dtype=dtype)
        return ActStat(total, self.count + other.count)

    def mean(self) -> torch.Tensor:
        """float32 mean ``|x|`` per input channel."""
        _divide_check(self.count, "ActStat")
        return (self.abs_sum / self.count).float()

    def save(self, path: str | Path) -> None:
        _save(path, {"abs_sum": self.abs_sum}, self.count, "act")

    @classmethod
    def load(cls, path: str | Path) -> ActStat:
        tensors, count = _load(path, "act")
        return cls(tensors["abs_sum"], count)
