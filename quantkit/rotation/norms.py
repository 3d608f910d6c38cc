"""Whether a norm can be folded: an RMSNorm computes w ⊙ x / rms(x), which commutes with a rotation of x once
w has moved into the linears that read its output. LayerNorm (mean subtraction, bias) and norms with a (1 + w)
weight offset do not, and are refused."""

from __future__ import annotations

import copy

import torch
from torch import nn

from quantkit.errors import QuantkitError

_PROBE_ROWS = 4
_PROBE_SCALE = 10.0  # probe inputs with mean(x²) ≈ 200, so that any eps below ~1e-2 stays invisible
_PROBE_TOL = 1e-4  # relative, in float32


def _refuse(path: str, problem: str) -> QuantkitError:
    return QuantkitError(
        f"cannot fold a rotation into this model: norm '{path}' {problem}; rotations need RMSNorm "
        "(w * x / rms(x)), so quantize this architecture without one (--rotate none)"
    )


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((actual - expected).abs().max() <= _PROBE_TOL * expected.abs().max().clamp_min(1.0))


def _householder(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """x @ (I - 2 v v^T / |v|²): a dense orthogonal map applied in O(n) per row."""
    return x - 2.0 * (x @ v)[:, None] * v[None, :] / (v @ v)


def check_rmsnorm(norm: nn.Module, path: str) -> None:
    """Raise a QuantkitError naming ``path`` unless ``norm`` computes w ⊙ x / rms(x): checked by its class and
    parameters, then by probing a float32 copy (with weight ones: it commutes with a rotation and keeps rms 1;
    with its own weight: it scales channel-wise by that weight)."""
    if isinstance(norm, (nn.LayerNorm, nn.GroupNorm)):
        raise _refuse(path, f"is a {type(norm).__name__} (mean subtraction and bias)")
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or weight.is_meta:
        raise _refuse(path, "has no per-channel weight loaded")
    if isinstance(getattr(norm, "bias", None), torch.Tensor):
        raise _refuse(path, "has a bias")
    probe = copy.deepcopy(norm).to("cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(_PROBE_ROWS, weight.shape[0], generator=generator) + 1.0) * _PROBE_SCALE
    v = torch.randn(weight.shape[0], generator=generator)
    with torch.no_grad():
        scaled = probe(x)
        probe.weight.fill_(1.0)
        unit = probe(x)
        if not _close(probe(_householder(x, v)), _householder(unit, v)):
            raise _refuse(path, "does not commute with a rotation of its input (mean subtraction or bias?)")
        if not _close(unit.pow(2).mean(-1).sqrt(), torch.ones(_PROBE_ROWS)):
            raise _refuse(path, "does not normalize to rms 1 with weight ones (a (1 + w) weight offset?)")
        if not _close(scaled, weight.detach().to("cpu", torch.float32)[None, :] * unit):
            raise _refuse(path, "does not scale its output channel-wise by its weight")
