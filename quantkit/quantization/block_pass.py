"""What quantizing one block needs besides the block and its input: the same for every block of a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner
from quantkit.quantization.methods import SolverConfig
from quantkit.quantization.solvers.tune import TuneConfig
from quantkit.quantization.spill import SpillFile

BlockSchemes = dict[str, QuantScheme | None]  # linear path relative to the block -> scheme (None: kept in float)


@dataclass(slots=True)
class BlockPass:
    """What quantizing a block needs besides the block and its input; the same for every block of a run."""

    arch: ArchSpec
    solvers: Sequence[SolverConfig]
    storage: torch.dtype  # the model's float dtype: scales are rounded to it, hidden states kept in it
    runner: BlockRunner | None = None  # None: data-free (round-to-nearest alone), no forward passes
    spill: SpillFile | None = None  # scratch file for activations (see StagedBlock)
    tune: TuneConfig | None = None  # block-output tuning after the weight solver (None: off)
    keep_reference: bool = False  # carry the float model's activations (tuning's targets, the head's refit)
    hessian_scratch: Path | None = None  # a file the solver parks a stage's Hessian in while it holds the factor
