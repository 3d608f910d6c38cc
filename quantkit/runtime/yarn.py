"""YaRN rotary scaling (gpt-oss's rope_parameters), computed as transformers' ``_compute_yarn_parameters`` computes
it: the original frequencies on the fast dimensions, those divided by ``factor`` on the slow ones, a linear ramp
between the correction range's bounds (``beta_fast`` / ``beta_slow`` rotations over the original context), and cos
and sin multiplied by an attention factor (``0.1 ln(factor) + 1`` unless given)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch


class YarnParams(Protocol):
    theta: float
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool


def yarn_inv_freq(rope: YarnParams, dim: int, extrapolated: torch.Tensor) -> torch.Tensor:
    """The ``[dim // 2]`` inverse frequencies of ``dim`` rotated dimensions; ``extrapolated``: the unscaled ones."""

    def bound(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = bound(rope.beta_fast), bound(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each dimension's original (extrapolated) frequency
    interpolated = 1.0 / (rope.factor * rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_attention_factor(params: Mapping[str, Any]) -> float:
    """``attention_factor`` when given, else from ``factor`` (and ``mscale`` / ``mscale_all_dim`` when both are set)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(params["factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    return mscale(factor)
