"""A weight solver written the way a new one is added to quantkit: this one module (its config with its options and
defaults, its capabilities, its hook, its registration). In the package it would sit in quantkit/quantization/
methods/ with its name added to ``ALGORITHM_MODULES``; tests import it before the CLI is built instead.

Fixed-ratio clipping: round-to-nearest with each group's range shrunk by ``shrink`` (codes beyond it saturate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantizedWeight
from quantkit.quantization.methods.hooks import Hooks, Solved, SolveJob
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.solvers.grid import compute_qparams, group_slices, quantize


@dataclass(frozen=True)
class ClipRTNConfig:
    shrink: float = option(0.9, "clip_rtn: fraction of each group's range the grid spans.")

    def __post_init__(self) -> None:
        if not 0 < self.shrink <= 1:
            raise QuantkitError(f"clip_rtn shrink must be in (0, 1], got {self.shrink}")


class _Hooks(Hooks):
    def solve(self, config: Any, job: SolveJob) -> Solved:
        scheme, storage = job.scheme, job.storage
        solved = []
        for w, name in zip(job.weights, job.full_names, strict=True):
            w = w.float()
            n, k = w.shape
            slices = group_slices(k, scheme)
            qweight = torch.empty(n, k, dtype=torch.int8)
            scales = torch.empty(n, len(slices))
            zeros = None if scheme.symmetric else torch.empty(n, len(slices), dtype=torch.int8)
            for g, cols in enumerate(slices):
                scale, zero = compute_qparams(w[:, cols] * config.shrink, scheme, scale_dtype=storage)
                qweight[:, cols] = quantize(w[:, cols], scale, zero, scheme)
                scales[:, g] = scale[:, 0]
                if zeros is not None and zero is not None:
                    zeros[:, g] = zero[:, 0]
            qw = QuantizedWeight(qweight=qweight, scale=scales, zero=zeros, g_idx=None, scheme=scheme)
            solved.append((qw, LayerRecord(name, scheme.name, None, None)))
        return solved


SWITCH = Switch("method")
CAPS = Capabilities(needs_calibration=False, records=(LayerRecord,))
SUMMARY = "clipped round-to-nearest: each group's range shrunk by a fixed ratio"
ALGORITHM = register("clip_rtn", ClipRTNConfig, Role.SOLVER, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
