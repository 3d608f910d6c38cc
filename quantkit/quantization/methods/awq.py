"""AWQ (Lin et al., 2023): per input channel, a scale searched on the block's calibration input and folded into the
previous module, then each linear's weight range clipped; the float block computes the same function after.
The searches are :mod:`quantkit.quantization.solvers.awq` and ``awq_clip``; the block driver is
:mod:`quantkit.quantization.methods.awq_block`. A transform: a weight solver (round-to-nearest or GPTQ) follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from quantkit.errors import QuantkitError
from quantkit.quantization.methods.awq_block import apply_awq_to_block
from quantkit.quantization.methods.hooks import BlockWork, Hooks
from quantkit.quantization.methods.records import kind_dict
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.solvers.awq import Objective


@dataclass
class AWQConfig:
    grid: int = option(20, "Scale search: ratios r = i / grid, i = 0 .. grid-1.", cli=False)
    duo_scaling: bool = option(True, "Scales x_mean**r / w_mean**(1-r) (else x_mean**r).", cli=False)
    clip: bool = option(True, "Search a clipped weight range per linear after the scales.", cli=False)
    clip_grid: int = option(20, "Clip search: shrink factors 1 - i / clip_grid.", cli=False)
    max_shrink: float = option(0.5, "Clip search: the smallest fraction of the range tried.", cli=False)
    search_samples: int | None = option(8, "Searches use the first N calibration windows (null: all).", cli=False)
    objective: Objective = option(
        "linear", "Scored output: linear (each linear's) or module (the parent's).", cli=False
    )
    clip_tokens: int = option(4096, "Clip search: at most this many evenly strided tokens.", cli=False)

    def __post_init__(self) -> None:
        if self.grid < 1 or self.clip_grid < 1:
            raise QuantkitError(f"AWQ grids must be >= 1 (grid={self.grid}, clip_grid={self.clip_grid})")
        if not 0.0 < self.max_shrink <= 1.0:
            raise QuantkitError(f"AWQ max_shrink must be in (0, 1], got {self.max_shrink}")
        if self.search_samples is not None and self.search_samples < 1:
            raise QuantkitError(f"AWQ search_samples must be >= 1 or None, got {self.search_samples}")
        if self.objective not in ("module", "linear"):
            raise QuantkitError(f"AWQ objective must be 'module' or 'linear', got {self.objective!r}")
        if self.clip_tokens < 1:
            raise QuantkitError(f"AWQ clip_tokens must be >= 1, got {self.clip_tokens}")


@dataclass(slots=True)
class AWQScaleRecord:
    """AWQ's scale choice for the linears ``name`` (the previous module) feeds."""

    KIND: ClassVar[str] = "awq-scale"
    name: str
    ratio: float | None  # None: identity scales (plain RTN) won
    rtn_error: float
    awq_error: float

    def to_dict(self) -> dict[str, Any]:
        return kind_dict(self)


@dataclass(slots=True)
class AWQClipRecord:
    """AWQ's clipping of one linear: the mean fraction of the abs max kept."""

    KIND: ClassVar[str] = "awq-clip"
    name: str
    mean_shrink: float

    def to_dict(self) -> dict[str, Any]:
        return kind_dict(self)


class _Hooks(Hooks):
    def transform_windows(self, config: Any) -> int | None:
        return config.search_samples  # the searches read the first windows only

    def transform(self, config: Any, work: BlockWork) -> list[Any]:
        """AWQ's scales and clipping on the block's quantized linears; its choices logged beside the solver's."""
        quantized = {name: s for name, s in work.schemes.items() if s is not None}
        report = apply_awq_to_block(
            work.block, work.arch, work.hidden, work.runner, quantized, config, scale_dtype=work.storage
        )
        records: list[Any] = [
            AWQScaleRecord(f"{work.prefix}.{g.prev}", g.ratio, g.rtn_error, g.awq_error) for g in report.groups
        ]
        records += [AWQClipRecord(f"{work.prefix}.{c.linear}", c.mean_shrink) for c in report.clips]
        return records


SWITCH = Switch("method")
CAPS = Capabilities(
    records=(AWQScaleRecord, AWQClipRecord),
    # asymmetric as in AutoAWQ; AWQ clips the range itself, so no MSE clipping after it
    scheme_defaults={"symmetric": False, "mse_clip": False},
)
SUMMARY = "AWQ: activation-aware scales folded into the previous module, then clipping"
ALGORITHM = register("awq", AWQConfig, Role.TRANSFORM, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
