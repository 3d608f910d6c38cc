"""Round-to-nearest: each weight rounded to its group's grid, data-free (no calibration, no forward pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantkit.quantization.methods.hooks import Hooks, Solved, SolveJob
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, register
from quantkit.quantization.solvers.grid import quantize_rtn, row_stack


@dataclass(frozen=True)
class RTNConfig:
    """Round-to-nearest: the scheme says everything (MSE clipping included)."""


class _Hooks(Hooks):
    def solve(self, config: Any, job: SolveJob) -> Solved:
        """Linears that share an input are rounded as one row-stacked matrix: integer grids are row by row (the
        same codes as one by one), and a scale shared by every row (per tensor, NVFP4's global scale) is then one
        for the fused projection the serving engine builds from them."""
        scheme = job.scheme
        stacked, rows = row_stack(job.weights, scheme)
        solved = quantize_rtn(stacked, scheme, scale_dtype=job.storage)
        return [
            (solved.rows(part), LayerRecord(name, scheme.name, None, None))
            for part, name in zip(rows, job.full_names, strict=True)
        ]


SWITCH = Switch("method")
CAPS = Capabilities(needs_calibration=False, records=(LayerRecord,))
SUMMARY = "round-to-nearest: data-free, each weight rounded to its group's grid"
ALGORITHM = register("rtn", RTNConfig, Role.SOLVER, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
