"""Where a run keeps what it does not need in memory at the moment: the algorithms say when something can go
(a solver holding its factor, a stage whose linears are solved), this module decides where it goes.

On the CPU, with a work directory: activations that are written once and read back once go to the spill file
(:class:`~quantkit.model.staged_block.StagedBlock`), a stage's Hessian is parked in a scratch file while GPTQ holds
its factor (:class:`HessianParking`), and the dense copies of solved linears are freed once no later step reads
them. On an accelerator everything stays in device memory (the host is not the constraint there).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantkit.format.scheme import QuantizedWeight
from quantkit.model.architectures import DOWN, GATE_UP, Stage
from quantkit.model.blocks import get_module
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.spill import SpillFile


@dataclass(slots=True)
class MemoryStrategy:
    spill: SpillFile | None = None  # the block's activation scratch file (None: kept in memory / recomputed)
    hessian_file: Path | None = None  # where a stage's Hessian is parked while the solver holds its factor

    def parking(self, hessian: torch.Tensor) -> HessianParking:
        return HessianParking(hessian, self.hessian_file)

    def before_stage(
        self, stage: Stage, staged: StagedBlock, quantized: dict[str, QuantizedWeight], keep_dense: bool
    ) -> None:
        """Free the dense weights of the linears already solved once no later step of the block runs them:
        after the gate/up stage's inputs h2 is complete (no attention linear runs again), and with every down_proj
        input spilled only down_proj runs again. ``keep_dense``: a later step runs the solved block again."""
        if keep_dense:
            return
        if stage.name == GATE_UP or (stage.name == DOWN and staged.output_reads_spill):
            drop_dense(staged.block, quantized)


def drop_dense(block: nn.Module, quantized: dict[str, QuantizedWeight]) -> None:
    """Free the dequantized float weights of linears already quantized (their integer weights are kept)."""
    for name in quantized:
        linear = get_module(block, name)
        linear.weight.data = linear.weight.data.new_empty(0)


class HessianParking:
    """Hands a CPU tensor's memory to a scratch file while the solver holds its factor, and reads it back in place.

    The tensor's storage is written out and resized to nothing, which frees it for every view at once (the caller's
    H included), and later resized back and refilled with the same bytes. With no path, a tensor not on the CPU or a
    storage that cannot be resized, parking does nothing. Reading the tensor while parked is an error.
    """

    def __init__(self, tensor: torch.Tensor, path: Path | None) -> None:
        self.tensor = tensor
        self.path = path if path is not None and tensor.device.type == "cpu" else None
        self.nbytes = tensor.untyped_storage().nbytes()
        self.parked = False

    def park(self) -> None:
        if self.path is None or self.parked:
            return
        storage = self.tensor.untyped_storage()
        with open(self.path, "wb") as f:
            f.write(_raw_view(storage))
            # on disk, then out of the page cache: a parked matrix kept as cache still counts against a cgroup
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            storage.resize_(0)
        except RuntimeError:  # not resizable (memory it does not own): keep it in memory
            return
        self.parked = True

    def unpark(self) -> None:
        if not self.parked:
            return
        storage = self.tensor.untyped_storage()
        storage.resize_(self.nbytes)
        with open(self.path, "rb") as f:  # type: ignore[arg-type]
            if f.readinto(_raw_view(storage)) != self.nbytes:
                raise OSError(f"scratch file {self.path} is truncated")
        self.parked = False


def _raw_view(storage: torch.UntypedStorage) -> memoryview:
    """The storage's bytes as a writable view, through ctypes: a numpy view would mark the storage not resizable."""
    return memoryview((ctypes.c_ubyte * storage.nbytes()).from_address(storage.data_ptr())).cast("B")
