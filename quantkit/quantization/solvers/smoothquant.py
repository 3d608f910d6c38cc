"""SmoothQuant (Xiao et al., 2023): the math of smoothing one scaling group's shared input.

Per input channel ``j`` of linears that read one input ``X`` (q/k/v after the input norm, gate/up after the
post-attention norm, down after up: AWQ's scaling groups), a factor

    s_j = max|X_j| ** alpha / max_i |W_ij| ** (1 - alpha)

(the weight maximum over every row of every linear of the group) moves quantization difficulty from the inputs
to the weights: the previous module's output is divided by ``s`` and the linears' input columns multiplied by it,
so the float block computes the same function (the fold is :func:`quantkit.quantization.solvers.awq.fold_scales`).
``alpha`` 0 leaves the inputs' outliers in place and flattens the weight columns; 1 flattens the inputs.

The alpha is chosen by :func:`search_alpha` over :func:`alpha_grid` against a loss the caller measures (the block
driver scores the block output with weights and inputs quantized). Pure functions: tensors in, tensors out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from quantkit.format.scheme import QuantScheme
from quantkit.quantization.solvers.grid import quantize_rtn, row_stack

# Channel maxima below this are treated as this: a dead input channel or an all-zero weight column would give a
# factor of 0 or infinity, and dividing a norm weight by either breaks the fold.
MAGNITUDE_FLOOR = 1e-5
# The factors themselves stay within [1e-5, 1e5], so neither side of the fold leaves float32's accurate range.
SCALE_RANGE = (1e-5, 1e5)

AlphaLoss = Callable[[float | None], float]  # None: no smoothing; else the alpha of every group


@dataclass(slots=True)
class AlphaSearch:
    alpha: float | None  # None: no alpha beat leaving the block unsmoothed
    plain_error: float  # the loss without smoothing
    error: float  # the loss at the chosen alpha (plain_error when None)
    errors: list[tuple[float, float]] = field(default_factory=list)  # (alpha, loss) for every grid point


def channel_absmax(x: torch.Tensor) -> torch.Tensor:
    """float32 [K]: the largest magnitude per channel of ``x`` [..., K] (features last)."""
    return x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()


def weight_absmax(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [K]: per input column, the largest ``|W_ij|`` over every row of every linear of the group."""
    return torch.cat([w.detach().abs().float() for w in weights]).amax(dim=0)


def smoothing_scales(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """float32 [K]: ``max|X_j|**alpha / max|W_:,j|**(1 - alpha)``, both maxima floored and the result clamped so that
    no factor is 0 or infinite (see :data:`MAGNITUDE_FLOOR`, :data:`SCALE_RANGE`)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    x = x_absmax.float().clamp_min(MAGNITUDE_FLOOR)
    w = w_absmax.float().clamp_min(MAGNITUDE_FLOOR)
    return (x.pow(alpha) / w.pow(1.0 - alpha)).clamp(*SCALE_RANGE)


def alpha_grid(steps: int) -> list[float]:
    """``steps + 1`` alphas from 0 to 1 inclusive (10 steps: 0.0, 0.1, ..., 1.0)."""
    if steps < 1:
        raise ValueError(f"the alpha grid needs at least 1 step, got {steps}")
    return [i / steps for i in range(steps + 1)]


def search_alpha(alphas: Sequence[float], loss: AlphaLoss) -> AlphaSearch:
    """The alpha of ``alphas`` with the lowest ``loss``. No smoothing is scored first and an alpha replaces it only
    with a strictly lower loss, so the search never does worse than the unsmoothed block on its data."""
    plain = loss(None)
    best = AlphaSearch(alpha=None, plain_error=plain, error=plain)
    for alpha in alphas:
        error = loss(alpha)
        best.errors.append((alpha, error))
        if error < best.error:
            best.alpha, best.error = alpha, error
    return best


def fake_quantize_weights(
    weights: Sequence[torch.Tensor], scheme: QuantScheme, scale_dtype: torch.dtype
) -> list[torch.Tensor]:
    """Round-to-nearest on ``scheme``'s grid of linears that share an input, row-stacked as the solvers stack them
    (a per-tensor or global scale is one for the fused projection), each dequantized to float32.

    Without MSE clipping: the search compares alphas, and the solver that follows applies the clipping itself."""
    search_scheme = dataclasses.replace(scheme, mse_clip=False) if scheme.mse_clip else scheme
    stacked, parts = row_stack(weights, search_scheme)
    dense = quantize_rtn(stacked, search_scheme, scale_dtype=scale_dtype).dequantize(torch.float32)
    return [dense[rows] for rows in parts]
