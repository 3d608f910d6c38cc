"""Weight quantization schemes and the container for a quantized weight.

A scheme is resolved once, before any solver loop, and is immutable afterwards.
Integer convention (the same as compressed-tensors): values are signed, in
``[-2**(bits-1), 2**(bits-1) - 1]``; zero points are signed in the same range; a weight dequantizes
as ``w = (q - zero) * scale`` (zero = 0 when symmetric).
Group of input column ``k``: ``g_idx[k]`` when a group index is recorded (act-order without static
groups), otherwise ``k // group_size`` (the last group is shorter when ``group_size`` does not divide
the in-features); per-channel (``group_size == -1``) is a single group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: int = 128  # -1: one group per output channel
    symmetric: bool = True
    act_order: bool = False  # GPTQ: process columns by descending Hessian diagonal
    static_groups: bool = False  # with act_order: groups fixed in the original column order
    mse_clip: bool = False  # search a shrunken range that lowers the (weighted) error

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise QuantkitError(f"bits={self.bits} is not supported; use one of {list(SUPPORTED_BITS)}")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantkitError(
                f"group size {self.group_size} is invalid; "
                "use a positive size such as 32, 64, 128, or -1 for per-channel"
            )

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def per_channel(self) -> bool:
        return self.group_size == -1

    def group_len(self, in_features: int) -> int:
        """Columns per group (the last group may be shorter)."""
        return in_features if self.per_channel else self.group_size

    def num_groups(self, in_features: int) -> int:
        return math.ceil(in_features / self.group_len(in_features))

    @property
    def name(self) -> str:
        """Short, stable name, e.g. ``w4-g128-sym`` or ``w8-ch-asym-actorder``."""
        group = "ch" if self.per_channel else f"g{self.group_size}"
        parts = [f"w{self.bits}", group, "sym" if self.symmetric else "asym"]
        if self.act_order:
            parts.append("actorder-static" if self.static_groups else "actorder")
        if self.mse_clip:
            parts.append("mse")
        return "-".join(parts)


@dataclass(slots=True)
class QuantizedWeight:
    """Integer weight of one Linear, with everything needed to dequantize it.

    qweight: int8 [N, K] signed integers; scale: float32 [N, G] (already rounded to the storage dtype);
    zero: int8 [N, G] signed zero points or None when symmetric; g_idx: int32 [K] or None.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None
    scheme: QuantScheme

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), int(self.qweight.shape[1]))

    def column_groups(self) -> torch.Tensor:
        """int64 [K]: the group of each input column."""
        k = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k) // self.scheme.group_len(k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        groups = self.column_groups()
        scale = self.scale.float()[:, groups]
        q = self.qweight.float()
        if self.zero is not None:
            q = q - self.zero.float()[:, groups]
        return (q * scale).to(dtype)
