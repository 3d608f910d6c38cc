"""What quantizing a block needs: the run-wide things (:class:`BlockRun`, the same for every block) and one block's
work in progress (:class:`BlockWork`, what the algorithms' hooks read and write)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantkit.format.scheme import QuantizedWeight
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.quantization.memory_strategy import MemoryStrategy
from quantkit.quantization.methods.composition import JobSteps
from quantkit.quantization.methods.hooks import BlockSchemes


@dataclass(slots=True)
class BlockRun:
    """The same for every block of a run."""

    arch: ArchSpec
    steps: JobSteps  # the job's algorithms, in role order
    storage: torch.dtype  # the model's float dtype: scales are rounded to it, hidden states kept in it
    runner: BlockRunner | None = None  # None: data-free (round-to-nearest alone), no forward passes
    memory: MemoryStrategy = field(default_factory=MemoryStrategy)


@dataclass(slots=True)
class BlockWork:
    """One block being quantized (:class:`quantkit.quantization.methods.hooks.BlockWork` is its view)."""

    block: nn.Module
    prefix: str
    schemes: BlockSchemes
    arch: ArchSpec
    storage: torch.dtype
    runner: BlockRunner
    hidden: torch.Tensor
    float_input: torch.Tensor
    kept_input: torch.Tensor | None = None
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    records: list[Any] = field(default_factory=list)
    output: torch.Tensor | None = None
    reference_output: torch.Tensor | None = None

    def write_back(self, name: str, weight: QuantizedWeight) -> None:
        """The float block now computes with the quantized weight (later stages see its output)."""
        get_module(self.block, name).weight.data = weight.dequantize(torch.float32)


@dataclass(slots=True)
class QuantizedBlock:
    weights: dict[str, QuantizedWeight]  # by linear path relative to the block
    output: torch.Tensor | None  # the next block's input (None when data-free)
    records: list[Any] = field(default_factory=list)
    reference_output: torch.Tensor | None = None  # with a float path: the float model's output, the next target
