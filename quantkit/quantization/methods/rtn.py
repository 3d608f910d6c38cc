"""Round-to-nearest: each weight rounded to its group's grid, data-free (no calibration, no forward pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantkit.format.scheme import QuantScheme
from quantkit.quantization.methods.hooks import Hooks, Parking, Solved
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.methods.registry import Algorithm, Capabilities, Role, Switch, register
from quantkit.quantization.solvers.grid import quantize_rtn


@dataclass(frozen=True)
class RTNConfig:
    """Round-to-nearest: the scheme says everything (MSE clipping included)."""


class _Hooks(Hooks):
    def solve(
        self,
        config: Any,
        weights: list[torch.Tensor],
        hessian: torch.Tensor | None,
        scheme: QuantScheme,
        storage: torch.dtype,
        names: list[str],
        parking: Parking | None = None,
    ) -> Solved:
        return [
            (quantize_rtn(w, scheme, scale_dtype=storage), LayerRecord(name, scheme.name, None, None))
            for w, name in zip(weights, names, strict=True)
        ]


ALGORITHM = register(
    Algorithm(
        name="rtn",
        config=RTNConfig,
        role=Role.SOLVER,
        caps=Capabilities(needs_calibration=False, records=(LayerRecord,)),
        hooks=_Hooks(),
        switch=Switch("method"),
        summary="round-to-nearest: data-free, each weight rounded to its group's grid",
    )
)
