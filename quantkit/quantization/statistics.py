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


# Columns per row strip of the upper triangle: narrower strips skip more of the redundant lower triangle, but as
# thinner, slower products.
_GRAM_STRIP = 256


def add_upper_gram_(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out += rows^T rows`` on the upper triangle only (in place); read it back with :func:`symmetric_from_upper`.

    The Gram matrix is symmetric, so half the product is redundant: for the 1536-wide down_proj inputs of a
    small model this is the largest single cost of the calibration pass. Row strips compute each diagonal tile
    and everything right of it; the lower triangle is left as scratch (only its diagonal tiles are touched),
    and mirroring happens once, when the Hessian is read, not once per batch.
    """
    k = rows.shape[1]
    if k < _GRAM_STRIP:  # small matrices: one full product is faster than several thin ones
        out.addmm_(rows.T, rows)
        return
    for i0 in range(0, k, _GRAM_STRIP):
        out[i0 : i0 + _GRAM_STRIP, i0:].addmm_(rows[:, i0 : i0 + _GRAM_STRIP].T, rows[:, i0:])


def symmetric_from_upper(upper: torch.Tensor) -> torch.Tensor:
    """The exactly symmetric matrix whose upper triangle (diagonal included) is ``upper``'s."""
    return torch.triu(upper) + torch.triu(upper, diagonal=1).T


def mirror_upper_(m: torch.Tensor) -> torch.Tensor:
    """In place, :func:`symmetric_from_upper` of ``m`` with no [K, K] temporary: the lower triangle is overwritten
    by the upper one's mirror, a strip of rows at a time (the same values: each entry is copied or kept)."""
    k = m.shape[0]
    for i0 in range(0, k, _GRAM_STRIP):
        i1 = min(i0 + _GRAM_STRIP, k)
        tile = m[i0:i1, i0:i1]
        tile.copy_(symmetric_from_upper(tile))
        m[i1:, i0:i1] = m[i0:i1, i1:].T
    return m


@dataclass(slots=True)
class HessianStat:
    """Sum of ``x^T x`` over calibration rows and the number of rows ``count``.

    ``gram`` [K, K] accumulates the upper triangle only (see :func:`add_upper_gram_`); ``xtx`` is the full,
    exactly symmetric sum.
    """

    gram: torch.Tensor
    count: int = 0

    @classmethod
    def zeros(cls, k: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> HessianStat:
        return cls(torch.zeros(k, k, dtype=dtype, device=device), 0)

    @property
    def in_features(self) -> int:
        return int(self.gram.shape[0])

    @property
    def xtx(self) -> torch.Tensor:
        return symmetric_from_upper(self.gram)

    def update(self, x: torch.Tensor) -> None:
        """Accumulate ``x^T x`` for inputs ``x`` [..., K] in the stat's dtype."""
        rows = _rows(x, self.in_features, "HessianStat.update").to(device=self.gram.device, dtype=self.gram.dtype)
        add_upper_gram_(self.gram, rows)
        self.count += int(rows.shape[0])

    def merge(self, other: HessianStat) -> HessianStat:
        _check_mergeable(self.gram, other.gram, "Hessian statistics")
        dtype = torch.promote_types(self.gram.dtype, other.gram.dtype)
        gram = self.gram.to(dtype) + other.gram.to(device=self.gram.device, dtype=dtype)
        return HessianStat(gram, self.count + other.count)

    def hessian(self) -> torch.Tensor:
        """float32 ``H = 2 / count * X^T X`` (divided in the accumulation dtype)."""
        _divide_check(self.count, "HessianStat")
        return (self.xtx * (2.0 / self.count)).float()

    def take_hessian(self) -> torch.Tensor:
        """:meth:`hessian`, bit for bit, made in the sum's own memory (no [K, K] temporary); the stat is empty
        afterwards. At K = 8192 that spares three 268 MB matrices at the end of a stage."""
        _divide_check(self.count, "HessianStat")
        h = mirror_upper_(self.gram).mul_(2.0 / self.count).float()
        self.gram, self.count = torch.zeros(0, 0, dtype=self.gram.dtype, device=self.gram.device), 0
        return h

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
