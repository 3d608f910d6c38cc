"""AWQ (Lin et al., 2023): activation-aware per-channel scaling, then weight clipping, one decoder block at a time.

For each scaling group ``prev -> linears`` (see :class:`~quantkit.model.architectures.ScalingGroup`) a scale ``s`` per
input channel is searched on a grid of ratios ``r``: ``s = x_mean**r / w_mean**(1 - r)`` (``x_mean**r`` without
duo scaling), normalised by ``sqrt(max(s) * min(s))``. A candidate is scored by fake-quantizing ``W * s`` and
dividing by ``s`` again, then measuring the squared error of an *inspected output* against the float output:

* ``objective="module"`` (as AutoAWQ): the output of the module the group feeds, i.e. the linears'
  common parent (``self_attn`` for q/k/v, ``mlp`` for gate/up), run on its captured calibration inputs; for a
  one-linear group (``o_proj``, ``down_proj``) the linear's own output, computed exactly from the input Gram
  matrix ``X^T X``: ``sum((dW @ G) * dW)``, whose cost does not depend on the number of tokens.
* ``objective="linear"`` (the paper's Eq. 4; the default): the sum over the group's linears of their own output
  errors, all through Gram matrices (cheapest; ignores attention / gating non-linearities).

Plain RTN (``s = 1``) is always the first candidate and a ratio replaces it only with a strictly lower error, so
the search never does worse than RTN on its data. The chosen scales are folded into ``prev`` (a norm's weight, or a
linear's output rows) and multiplied into the linears' input columns: the float block computes the same function.

Clipping follows (:mod:`quantkit.quantization.solvers.awq_clip`); the block driver is
:mod:`quantkit.quantization.awq_block`. The functions here are pure: weights and statistics in, scales out.

Searches quantize with the linear's scheme minus ``mse_clip`` (the final RTN/GPTQ pass applies it), with scales
rounded to ``scale_dtype`` as the checkpoint will store them.

Cost: the linear objective scores every candidate through Gram matrices, so only the capture that feeds them
grows with ``search_samples``; the module objective runs the module again for every candidate and grows linearly
with ``search_samples``. Hence the defaults (linear objective, first 8 samples), quantkit's own: ``--method awq``
and recipes use them as they are. The timings are in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.solvers.grid import compute_qparams

Objective = Literal["module", "linear"]
QRange = tuple[torch.Tensor, torch.Tensor]  # per-row (lo, hi) [R, 1]
LossFn = Callable[[Sequence[torch.Tensor]], float]  # candidate dequantized weights (one per linear) -> error


class AWQSettings(Protocol):
    """The options the searches read (``quantization/methods/awq.py`` holds them, with their defaults)."""

    grid: int  # ratios r = i / grid, i = 0 .. grid-1
    duo_scaling: bool  # s = x_mean**r / w_mean**(1-r); else x_mean**r
    clip: bool
    clip_grid: int  # shrink factors 1 - i / clip_grid, from 1.0 down to max_shrink
    max_shrink: float
    search_samples: int | None  # use only the first N calibration samples for the searches (None: all)
    objective: Objective
    clip_tokens: int  # clip search: at most this many (evenly strided) input tokens


@dataclass(slots=True)
class ScaleSearchResult:
    scales: torch.Tensor  # float32 [K]; all ones when no ratio beat RTN
    ratio: float | None  # None: identity scales (plain RTN) won
    rtn_error: float  # inspected-output MSE with s = 1
    error: float  # inspected-output MSE with the chosen scales
    errors: list[tuple[float, float]] = field(default_factory=list)  # (ratio, error) for every grid point


# ----------------------------------------------------------------------------------------------- tensor helpers


def _search_scheme(scheme: QuantScheme) -> QuantScheme:
    return dataclasses.replace(scheme, mse_clip=False) if scheme.mse_clip else scheme


def _grouped(w: torch.Tensor, group_len: int) -> torch.Tensor:
    """``w`` [..., K] -> [..., G, group_len], the last group zero-padded (zeros never change a group's range)."""
    k = w.shape[-1]
    groups = -(-k // group_len)
    pad = groups * group_len - k
    if pad:
        w = F.pad(w, (0, pad))
    return w.reshape(*w.shape[:-1], groups, group_len)


def _ungrouped(w: torch.Tensor, k: int) -> torch.Tensor:
    return w.reshape(*w.shape[:-2], -1)[..., :k]


def _fake_quantize_rows_(
    rows: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype, lo_hi: QRange | None = None
) -> torch.Tensor:
    """In place: fake-quantize each row of float32 ``rows`` [R, L] as one group. ``lo_hi``: the rows' known
    (min, max) [R, 1] (e.g. after clamping). Bit-identical to ``fake_quantize(w, *compute_qparams(w))`` with fewer
    passes over memory: one range pass, then in-place arithmetic."""
    lo, hi = torch.aminmax(rows, dim=1, keepdim=True) if lo_hi is None else lo_hi
    scale, zero = compute_qparams(torch.cat([lo, hi], dim=1), scheme, scale_dtype=scale_dtype)
    q = rows.div_(scale).round_()
    if zero is None:
        return q.clamp_(scheme.qmin, scheme.qmax).mul_(scale)
    z = zero.float()
    return q.add_(z).clamp_(scheme.qmin, scheme.qmax).sub_(z).mul_(scale)


def _padded(w: torch.Tensor, padded_len: int) -> torch.Tensor:
    """A fresh float32 copy of ``w`` [N, K] with zero columns up to ``padded_len``."""
    out = torch.zeros(w.shape[0], padded_len, dtype=torch.float32, device=w.device)
    out[:, : w.shape[1]] = w
    return out


def fake_quantize_weight(
    weight: torch.Tensor, scheme: QuantScheme, *, scale_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """float32 dequantized RTN of ``weight`` [N, K], all groups at once (same values as ``quantize_rtn``)."""
    k = weight.shape[1]
    gl = scheme.group_len(k)
    buf = _padded(weight.detach(), scheme.num_groups(k) * gl)
    _fake_quantize_rows_(buf.view(-1, gl), scheme, scale_dtype)
    return buf[:, :k]


@dataclass(slots=True)
class _SearchLinear:
    """One linear of a scaling group, zero-padded to whole groups once, so candidates need no padding pass."""

    weight: torch.Tensor  # float32 [N, K_padded]
    scheme: QuantScheme | None  # None: not quantized
    in_features: int

    @classmethod
    def of(cls, w: torch.Tensor, scheme: QuantScheme | None) -> _SearchLinear:
        k = w.shape[1]
        if scheme is None:
            return cls(w.detach().float(), None, k)
        scheme = _search_scheme(scheme)
        return cls(_padded(w.detach(), scheme.num_groups(k) * scheme.group_len(k)), scheme, k)

    def candidate(self, scales: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
        """``Q(W * s) / s`` [N, K] (``W`` itself when unquantized)."""
        if self.scheme is None:
            return self.weight
        s = F.pad(scales, (0, self.weight.shape[1] - self.in_features), value=1.0)
        buf = self.weight * s
        _fake_quantize_rows_(buf.view(-1, self.scheme.group_len(self.in_features)), self.scheme, scale_dtype)
        return buf.div_(s)[:, : self.in_features]


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]).float()


def _strided_tokens(rows: torch.Tensor, limit: int) -> torch.Tensor:
    step = max(1, -(-rows.shape[0] // limit))
    return rows[::step]


def weight_mean(weights: Sequence[torch.Tensor], schemes: Sequence[QuantScheme | None]) -> torch.Tensor:
    """float32 [K]: per input channel, the mean over all rows of ``|W|`` normalised by its group's abs max."""
    normalised = []
    for w, scheme in zip(weights, schemes, strict=True):
        k = w.shape[1]
        gl = scheme.group_len(k) if scheme is not None else k
        grouped = _grouped(w.detach().float().abs(), gl)
        grouped = grouped / grouped.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        normalised.append(_ungrouped(grouped, k))
    return torch.cat(normalised).mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """``x_mean**r / w_mean**(1-r)`` (``w_mean`` None: no duo scaling), >= 1e-4, normalised by sqrt(max*min)."""
    s = x_mean.float().pow(ratio)
    if w_mean is not None:
        s = s / w_mean.float().pow(1.0 - ratio).clamp_min(1e-4)
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


# ------------------------------------------------------------------------------------------------- scale search


def gram_loss(weights: Sequence[torch.Tensor], gram: torch.Tensor, count: int) -> LossFn:
    """Mean squared output error of linears sharing the input whose Gram matrix is ``gram`` = X^T X (``count`` rows)."""
    originals = [w.detach().float() for w in weights]
    denom = float(count * sum(w.shape[0] for w in originals))

    def loss(candidates: Sequence[torch.Tensor]) -> float:
        total = 0.0
        for w, c in zip(originals, candidates, strict=True):
            delta = c - w
            total += float(((delta @ gram) * delta).sum())
        return total / denom

    return loss


def awq_scale_search(
    weights: Sequence[torch.Tensor],
    schemes: Sequence[QuantScheme | None],
    x_mean: torch.Tensor,
    loss_fn: LossFn,
    config: AWQSettings,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> ScaleSearchResult:
    """Grid search of the per-input-channel scales of one scaling group (pure: ``weights`` are not modified).

    ``weights``: the group's linear weights [N_i, K] (scheme None: left unquantized); ``x_mean`` [K]: mean |x| of the
    group input; ``loss_fn`` scores the candidate dequantized weights ``Q(W * s) / s``. RTN (s = 1) is scored first
    and only a strictly lower error replaces it.
    """
    linears = [_SearchLinear.of(w, scheme) for w, scheme in zip(weights, schemes, strict=True)]
    ones = torch.ones(linears[0].in_features, device=weights[0].device)
    rtn_error = loss_fn([lin.candidate(ones, scale_dtype) for lin in linears])
    w_mean = weight_mean(weights, schemes) if config.duo_scaling else None
    best = ScaleSearchResult(scales=ones, ratio=None, rtn_error=rtn_error, error=rtn_error)
    for i in range(config.grid):
        ratio = i / config.grid
        scales = candidate_scales(x_mean, w_mean, ratio)
        error = loss_fn([lin.candidate(scales, scale_dtype) for lin in linears])
        best.errors.append((ratio, error))
        if error < best.error:
            best.scales, best.ratio, best.error = scales, ratio, error
    return best


def fold_scales(
    prev_module: nn.Module, linears: Sequence[nn.Linear], scales: torch.Tensor, norm_offset: float = 0.0
) -> None:
    """In place: ``prev``'s output channels divided by ``scales`` and the linears' input columns multiplied by them.

    ``prev`` is a norm with an elementwise ``weight`` [K] (and optional ``bias``) or a Linear with K outputs. A norm
    that multiplies by ``norm_offset + weight`` (Gemma's, offset 1) keeps its form: the weight becomes
    ``(offset + weight) / s - offset``.
    """
    k = scales.numel()
    s = scales.detach().float()
    with torch.no_grad():
        if isinstance(prev_module, nn.Linear):
            if prev_module.out_features != k:
                raise QuantkitError(f"cannot fold {k} scales into a Linear with {prev_module.out_features} outputs")
            prev_module.weight.copy_(prev_module.weight.float() / s[:, None])
        else:
            weight = getattr(prev_module, "weight", None)
            if weight is None or weight.shape != (k,):
                raise QuantkitError(
                    f"cannot fold {k} scales into {type(prev_module).__name__}: no weight of shape [{k}]"
                )
            weight.copy_((weight.float() + norm_offset) / s - norm_offset)
        bias = getattr(prev_module, "bias", None)
        if bias is not None:
            bias.copy_(bias.float() / s)
        for linear in linears:  # a Linear, or a module holding a [N, K] weight (an MoE router)
            if linear.weight.shape[1] != k:
                raise QuantkitError(f"cannot fold {k} scales into a Linear with {linear.weight.shape[1]} inputs")
            linear.weight.copy_(linear.weight.float() * s[None, :])
