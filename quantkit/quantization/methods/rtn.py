"""Round-to-nearest: each weight rounded to its group's grid, data-free (no calibration, no forward pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantkit.quantization.methods.hooks import Hooks, Solved, SolveJob
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, register
from quantkit.quantization.solvers.grid import quantize_rtn


@dataclass(frozen=True)
class RTNConfig:
    """Round-to-nearest: the scheme says everything (MSE clipping included)."""


class _Hooks(Hooks):
    def solve(self, config: Any, job: SolveJob) -> Solved:
        scheme = job.scheme
        return [
            (quantize_rtn(w, scheme, scale_dtype=job.storage), LayerRecord(name, scheme.name, None, None))
            for w, name in zip(job.weights, job.full_names, strict=True)
        ]


SWITCH = Switch("method")
CAPS = Capabilities(needs_calibration=False, records=(LayerRecord,))
SUMMARY = "round-to-nearest: data-free, each weight rounded to its group's grid"
ALGORITHM = register("rtn", RTNConfig, Role.SOLVER, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
