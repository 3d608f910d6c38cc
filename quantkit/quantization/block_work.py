"""What quantizing a block needs besides the block's own work in progress
(:class:`quantkit.quantization.methods.hooks.BlockWork`): the run-wide things, the same for every block, and what
a block's quantization returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from quantkit.format.scheme import KVCacheScheme, QuantizedWeight
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner
from quantkit.quantization.memory_strategy import MemoryStrategy
from quantkit.quantization.methods.composition import JobSteps

if TYPE_CHECKING:
    from quantkit.quantization.distributed_run import RankBlocks


@dataclass(slots=True)
class BlockRun:
    """The same for every block of a run."""

    arch: ArchSpec
    steps: JobSteps  # the job's algorithms, in role order
    storage: torch.dtype  # the model's float dtype: scales are rounded to it, hidden states kept in it
    runner: BlockRunner | None = None  # None: data-free (round-to-nearest alone), no forward passes
    memory: MemoryStrategy = field(default_factory=MemoryStrategy)
    input_observer: str = "minmax"  # how static input scales are calibrated (quantization/input_ranges.py)
    sample_every: int = 0  # the MSE observer's token-row stride (0: no sample)
    kv_cache: KVCacheScheme | None = None  # calibrate k_scale / v_scale for an FP8 KV cache
    moe_calibration: str = "all"  # mixture of experts: every token through every expert, or the routed ones
    ranks: RankBlocks | None = None  # several processes (torchrun): this rank's windows and the exchanges


@dataclass(slots=True)
class QuantizedBlock:
    weights: dict[str, QuantizedWeight]  # by linear path relative to the block
    output: torch.Tensor | None  # the next block's input (None when data-free)
    records: list[Any] = field(default_factory=list)
    reference_output: torch.Tensor | None = None  # with a float path: the float model's output, the next target
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # more checkpoint tensors (k_scale, v_scale)
