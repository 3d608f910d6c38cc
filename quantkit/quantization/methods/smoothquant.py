"""SmoothQuant (Xiao et al., 2023; llm-compressor's SmoothQuantModifier): per input channel of each scaling group,
a factor ``max|X_j|**alpha / max|W_:,j|**(1-alpha)`` divides the group's input (folded into the preceding norm or
linear) and multiplies the linears' weight columns, so the outlier channels of the activations move into the
weights, where a per-channel weight grid absorbs them. The float block computes the same function after.

A transform (``--method smoothquant+gptq``; ``smoothquant`` alone rounds to nearest after it, as llm-compressor's
SmoothQuant + QuantizationModifier): the weight solver sees the smoothed weights and, since the stage inputs are
computed from the smoothed block, the Hessian and static input ranges of the smoothed inputs. Meant for schemes
that quantize activations (W8A8 above all; FP8, NVFP4); with a weight-only scheme it only reshapes the weights.

The alpha is searched per block (one for all its groups) on the calibration windows unless fixed; the block driver
is :mod:`quantkit.quantization.methods.smoothquant_block`, the math :mod:`quantkit.quantization.solvers.smoothquant`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from quantkit.errors import QuantkitError
from quantkit.quantization.methods.hooks import BlockWork, Hooks
from quantkit.quantization.methods.records import kind_dict
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.methods.smoothquant_block import smooth_block


@dataclass(frozen=True)
class SmoothQuantConfig:
    alpha: float | None = option(
        None,
        "SmoothQuant: migration strength in [0, 1] (llm-compressor's smoothing_strength); not given: searched per "
        "block on the calibration windows (block output error, weights and inputs quantized). A weight-only scheme "
        "has no activations to smooth: the search then keeps a block unsmoothed unless its weight error drops.",
    )
    grid: int = option(10, "Alpha search: alphas i / grid, i = 0 .. grid (no smoothing is always tried).", cli=False)
    search_samples: int | None = option(8, "Alpha search: on the first N windows (null: all).", cli=False)

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise QuantkitError(f"SmoothQuant alpha must be in [0, 1] (or not given, to search it), got {self.alpha}")
        if self.grid < 1:
            raise QuantkitError(f"SmoothQuant grid must be >= 1, got {self.grid}")
        if self.search_samples is not None and self.search_samples < 1:
            raise QuantkitError(f"SmoothQuant search_samples must be >= 1 or null, got {self.search_samples}")


@dataclass(slots=True)
class SmoothQuantRecord:
    """SmoothQuant's choice for one block (``name``: its prefix): the alpha (None: left unsmoothed) and, when it was
    searched, the block output's mean squared error (weights and inputs quantized) without and with smoothing."""

    KIND: ClassVar[str] = "smoothquant"
    name: str
    alpha: float | None
    plain_error: float | None  # None: a fixed alpha, nothing measured
    smooth_error: float | None
    groups: int  # scaling groups folded (under GQA v_proj -> o_proj cannot be)

    def to_dict(self) -> dict[str, Any]:
        return kind_dict(self)


class _Hooks(Hooks):
    def transform(self, config: Any, work: BlockWork) -> list[Any]:
        """Smooth the float block on its calibration input, before its stages are run and solved."""
        quantized = {name: s for name, s in work.schemes.items() if s is not None}
        report = smooth_block(
            work.block, work.arch, work.hidden, work.runner, quantized, config, work.storage, work.moe_calibration
        )
        search = report.search
        plain = None if search is None else search.plain_error
        smooth = None if search is None else search.error
        return [SmoothQuantRecord(work.prefix, report.alpha, plain, smooth, len(report.groups))]


SWITCH = Switch("method")
CAPS = Capabilities(records=(SmoothQuantRecord,))
SUMMARY = "SmoothQuant: activation outliers moved into the weights by per-channel factors folded into the block"
ALGORITHM = register(
    "smoothquant", SmoothQuantConfig, Role.TRANSFORM, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY
)
