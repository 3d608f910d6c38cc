"""GPTQ (Frantar et al., 2022): each stage's linears solved column by column against the Hessian of their inputs,
the rounding error of each column spread over the columns not yet quantized. The math is
:func:`quantkit.quantization.solvers.gptq.gptq_solve`; this module holds its options and its hook."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.quantization.methods.hooks import Hooks, Solved, SolveJob
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.solvers.gptq import gptq_solve, hessian_weighted_error
from quantkit.quantization.solvers.grid import row_stack


@dataclass
class GPTQConfig:
    damp: float = option(0.01, "GPTQ damping, as a fraction of the mean Hessian diagonal.", flag="--damp")
    block_size: int = option(128, "GPTQ lazy-update block size.", flag="--block-size")
    damp_retries: int = option(3, "Extra factorisation attempts, each with more damping.", cli=False)
    damp_growth: float = option(10.0, "Damping multiplier between attempts.", cli=False)

    def __post_init__(self) -> None:
        if not 0 <= self.damp < 1:
            raise QuantkitError(f"GPTQ damp must be in [0, 1), got {self.damp}")
        if self.damp_growth <= 1 or self.damp_retries < 0:
            raise QuantkitError(
                f"invalid GPTQ damping (damp={self.damp}, growth={self.damp_growth}, retries={self.damp_retries}); "
                "use damp >= 0, damp_growth > 1, damp_retries >= 0"
            )
        if self.block_size <= 0:
            raise QuantkitError(f"GPTQ block size must be positive, got {self.block_size}")


class _Hooks(Hooks):
    def solve(self, config: Any, job: SolveJob) -> Solved:
        """Linears that share an input (one Hessian): rows are independent given H, so solving the row-stacked
        matrix once equals solving each linear alone, with one factorisation and one column sweep."""
        hessian, scheme = job.hessian, job.scheme
        assert hessian is not None, "GPTQ needs the stage's Hessian"
        stacked, parts = row_stack(job.weights, scheme)
        result = gptq_solve(  # the stacked copy is the solver's alone: it works in it and frees it early
            stacked,
            hessian,
            scheme,
            config,
            scale_dtype=job.storage,
            name=", ".join(job.full_names),
            overwrite=True,
            parking=job.parking,
        )
        del stacked
        out = []
        for w, name, rows in zip(job.weights, job.full_names, parts, strict=True):
            part = result.weight.rows(rows)
            loss = hessian_weighted_error(w, part.dequantize(), hessian)
            out.append((part, LayerRecord(name, scheme.name, loss, result.damp, result.fell_back_to_rtn)))
        return out


SWITCH = Switch("method")
CAPS = Capabilities(
    needs_hessian=True,
    records=(LayerRecord,),
    # columns by descending Hessian diagonal in static groups, and a Hessian-weighted range search
    scheme_defaults={"act_order": True, "mse_clip": True},
)
SUMMARY = "GPTQ: each linear solved column by column against its inputs' Hessian"
ALGORITHM = register("gptq", GPTQConfig, Role.SOLVER, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
