"""Whether a norm can be folded: an RMSNorm computes (offset + w) ⊙ x / rms(x), with the weight offset its
architecture declares (``ArchSpec.norm_offset``: 0 for Llama's w * x / rms(x), 1 for the norms Gemma and Qwen3.5
store around zero). It commutes with a rotation of x once offset + w has moved into the linears that read its output
and its weight is set to 1 - offset, so that it multiplies by exactly one. LayerNorm (mean subtraction, bias) and a
norm that does not compute the declared form are refused."""

from __future__ import annotations

import copy

import torch
from torch import nn

from quantkit.errors import QuantkitError

_PROBE_ROWS = 4
_PROBE_SCALE = 10.0  # probe inputs with mean(x²) ≈ 200, so that any eps below ~1e-2 stays invisible
_PROBE_TOL = 1e-4  # relative, in float32


def unit_weight(offset: float) -> float:
    """The weight with which a norm of weight offset ``offset`` multiplies by one: what a folded norm stores."""
    return 1.0 - offset


def norm_scale(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """What the norm multiplies each channel by, offset + w, in float64 (exact for any stored weight)."""
    return weight.detach().to(torch.float64) + offset


def _factor(offset: float) -> str:
    return "w" if offset == 0 else f"({offset:g} + w)"


def _form(offset: float) -> str:
    return f"{_factor(offset)} * x / rms(x)"


def _refuse(path: str, problem: str, offset: float) -> QuantkitError:
    return QuantkitError(
        f"cannot fold a rotation into this model: norm '{path}' {problem}; rotations need RMSNorm "
        f"({_form(offset)}, as the architecture declares), so quantize this architecture without one (--rotate none)"
    )


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((actual - expected).abs().max() <= _PROBE_TOL * expected.abs().max().clamp_min(1.0))


def _householder(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """x @ (I - 2 v v^T / |v|²): a dense orthogonal map applied in O(n) per row."""
    return x - 2.0 * (x @ v)[:, None] * v[None, :] / (v @ v)


def check_rmsnorm(norm: nn.Module, path: str, offset: float = 0.0) -> None:
    """Raise a QuantkitError naming ``path`` unless ``norm`` computes (offset + w) ⊙ x / rms(x): checked by its class
    and parameters, then by probing a float32 copy (with weight 1 - offset, the unit scale: it commutes with a
    rotation and keeps rms 1; with its own weight: it scales channel-wise by offset + that weight)."""
    if isinstance(norm, (nn.LayerNorm, nn.GroupNorm)):
        raise _refuse(path, f"is a {type(norm).__name__} (mean subtraction and bias)", offset)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or weight.is_meta:
        raise _refuse(path, "has no per-channel weight loaded", offset)
    if isinstance(getattr(norm, "bias", None), torch.Tensor):
        raise _refuse(path, "has a bias", offset)
    probe = copy.deepcopy(norm).to("cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(_PROBE_ROWS, weight.shape[0], generator=generator) + 1.0) * _PROBE_SCALE
    v = torch.randn(weight.shape[0], generator=generator)
    unit_w = unit_weight(offset)
    with torch.no_grad():
        scaled = probe(x)
        probe.weight.fill_(unit_w)
        unit = probe(x)
        if not _close(probe(_householder(x, v)), _householder(unit, v)):
            raise _refuse(path, "does not commute with a rotation of its input (mean subtraction or bias?)", offset)
        if not _close(unit.pow(2).mean(-1).sqrt(), torch.ones(_PROBE_ROWS)):
            hint = "a (1 + w) weight offset?" if offset == 0 else "another weight offset, e.g. w * x / rms(x)?"
            raise _refuse(path, f"does not normalize to rms 1 with weight {unit_w:g} ({hint})", offset)
        expected = norm_scale(weight, offset).to("cpu", torch.float32)[None, :] * unit
        if not _close(scaled, expected):
            raise _refuse(path, f"does not scale its output channel-wise by {_factor(offset)}", offset)
