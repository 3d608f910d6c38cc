"""Round-to-nearest: each weight rounded to its group's grid, data-free (no calibration, no forward pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantkit.quantization.methods.hooks import Hooks, Solved, SolveJob
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, register
from quantkit.quantization.solvers.grid import quantize_rtn


@dataclass(frozen=True)
class RTNConfig:
    """Round-to-nearest: the scheme says everything (MSE clipping included)."""


class _Hooks(Hooks):
    def solve(self, config: Any, job: SolveJob) -> Solved:
        """Linears that share an input are rounded as one row-stacked matrix: integer grids are row by row (the
        same codes as one by one), and a scale shared by every row (per tensor, NVFP4's global scale) is then one
        for the fused projection the serving engine builds from them."""
        scheme = job.scheme
        stacked = quantize_rtn(torch.cat(job.weights), scheme, scale_dtype=job.storage)
        out, start = [], 0
        for w, name in zip(job.weights, job.full_names, strict=True):
            out.append((stacked.rows(slice(start, start + w.shape[0])), LayerRecord(name, scheme.name, None, None)))
            start += w.shape[0]
        return out


SWITCH = Switch("method")
CAPS = Capabilities(needs_calibration=False, records=(LayerRecord,))
SUMMARY = "round-to-nearest: data-free, each weight rounded to its group's grid"
ALGORITHM = register("rtn", RTNConfig, Role.SOLVER, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
