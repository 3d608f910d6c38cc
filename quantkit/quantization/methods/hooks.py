"""The hooks an algorithm gives the run, and what its hooks receive.

An algorithm subclasses :class:`Hooks` and overrides the hooks of its role (:class:`~.registry.Role`); the
others stay no-ops. What the hooks receive is defined here, beside them: the block loop (``quantization/``)
imports these types to fill them, and the algorithms never import the block loop, so the arrow runs one way
(tests/test_import_rules.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.model.architectures import ArchSpec, Stage
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.model.source_weights import SourceWeights
from quantkit.model.staged_block import StagedBlock
from quantkit.model.staged_moe import ALL

BlockSchemes = dict[str, QuantScheme | None]  # linear path relative to the block -> scheme (None: kept in float)
Solved = list[tuple[QuantizedWeight, Any]]  # (quantized weight, its LayerRecord) per linear


class Parking(Protocol):
    """Hands a tensor's memory away while the solver does not read it (the run's memory strategy decides how)."""

    def park(self) -> None: ...

    def unpark(self) -> None: ...


class JobView(Protocol):
    """A run as its job-level hooks see it."""

    model: str  # the model argument as given
    source: Path  # the float model's directory
    arch: ArchSpec
    weights: SourceWeights
    storage: torch.dtype
    unties_head: bool  # an algorithm of the job gives the checkpoint a head of its own
    calibration_ids: torch.Tensor | None  # the calibration windows [n, T] (None: a data-free run)
    forward_dtype: torch.dtype  # the precision of the forward passes (--compute-dtype)
    residual_basis: torch.Tensor | None  # the orthogonal Q folded into the residual stream (x -> x Q); None: none


class WorkView(Protocol):
    """The work directory as the hooks that run after the last block see it."""

    path: Path

    def load_hidden(self, device: torch.device | None = None) -> torch.Tensor: ...

    def load_reference(self, device: torch.device | None = None) -> torch.Tensor | None: ...


@dataclass(slots=True)
class BlockWork:
    """One block being quantized: what the block-level hooks read and write (the block loop fills it)."""

    block: nn.Module
    prefix: str
    schemes: BlockSchemes
    arch: ArchSpec
    storage: torch.dtype
    runner: BlockRunner
    hidden: torch.Tensor  # the block's calibration input (the solved output is later written over it)
    float_input: torch.Tensor  # the float model's input to this block (``hidden`` when no stream is carried)
    kept_input: torch.Tensor | None = None  # a copy of ``hidden`` for hooks that run the solved block again
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)  # solved, by path relative to the block
    records: list[Any] = field(default_factory=list)
    output: torch.Tensor | None = None  # the solved block's output (after the stages)
    reference_output: torch.Tensor | None = None  # the float block's output on ``float_input``
    moe_calibration: str = ALL  # a mixture of experts: which tokens an expert's statistics sum over (--moe-calibration)

    def write_back(self, name: str, weight: QuantizedWeight) -> None:
        """The block computes with ``weight`` (dequantized) from now on: later stages see its output."""
        get_module(self.block, name).weight.data = weight.dequantize(torch.float32)


@dataclass(slots=True)
class SolveJob:
    """Linears of one block that share an input and a scheme, as a solver (and a target algorithm) gets them."""

    prefix: str  # the block, e.g. "model.layers.3"
    names: list[str]  # the linears, relative to the block
    weights: list[torch.Tensor]  # what the solver fits (the linears' float weights, or a target algorithm's)
    hessian: torch.Tensor | None  # of the shared input (None for a solver that needs none)
    scheme: QuantScheme
    storage: torch.dtype  # scales are rounded to it
    parking: Callable[[torch.Tensor], Parking] | None = None  # how the Hessian's memory may be handed away

    @property
    def full_names(self) -> list[str]:
        return [f"{self.prefix}.{name}" for name in self.names]


class Companion(Protocol):
    """Runs beside the quantized block through its stages (a target algorithm's view of the float block)."""

    def open_stage(self, staged: StagedBlock, stage: Stage, in_features: int) -> Iterator[torch.Tensor]:
        """Start a stage; the returned iterator yields the companion's own inputs batch by batch."""
        ...

    def observe(self, staged: StagedBlock, stage: Stage, rows: slice, inputs: torch.Tensor, own: torch.Tensor) -> None:
        """One mini-batch of the stage: the quantized block's ``inputs`` and the companion's ``own``."""
        ...

    def close_stage(self) -> Any:
        """What the stage's targets need (handed to :meth:`Hooks.target_weights`)."""
        ...

    def float_output(self) -> torch.Tensor:
        """The float block's output, once the last stage has run."""
        ...


class SummingCompanion(Companion, Protocol):
    """A companion whose stage data are sums over the calibration tokens: the block loop takes them chunk by chunk
    and adds them up in the fixed order of the Hessians' sums (``quantkit.distributed.reduce``), so that they have
    the same bits on one process or several."""

    def take_chunk(self) -> dict[str, torch.Tensor]:
        """The sums over the mini-batches seen since the last call (the same keys on every process); later ones go
        into fresh buffers."""
        ...

    def put_totals(self, totals: dict[str, torch.Tensor] | None, count: int) -> None:
        """The stage's sums over every mini-batch and their row count, before :meth:`close_stage` (None: a process
        that does not solve the stage, and needs none)."""
        ...


class Hooks:
    """No-op defaults; each algorithm overrides the hooks of its role."""

    # -- job level: before the first block and after the last --
    def prepare(self, config: Any, job: JobView) -> Any:
        """Checks and job-wide state, before any work (returned state is handed to the hooks below)."""
        return None

    def outer_tensors(self, state: Any, job: JobView) -> dict[str, torch.Tensor]:
        """Tensors outside the blocks that replace the source's, computed once at the start (kept for a resume)."""
        return {}

    def first_input(
        self, state: Any, outer: dict[str, torch.Tensor], input_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The first block's calibration input, when it is not the source's embedding of ``input_ids``."""
        return None

    def residual_basis(self, state: Any) -> torch.Tensor | None:
        """The orthogonal matrix this algorithm folds into the residual stream (a rotation), else None."""
        return None

    def fold(self, state: Any, block: nn.Module, index: int) -> None:
        """Rewrite a block's float weights as it is loaded, before anything else sees it (``index``: its layer, whose
        spec ``ArchSpec.for_layer`` gives: a hybrid model's layers differ)."""

    def final_tensors(
        self, config: Any, job: JobView, work: WorkView, outer: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Tensors outside the blocks to write instead of ``outer``'s (or the source's), after the last block; a
        name mapped to None is not written (a weight written in another form, e.g. packed)."""
        return {}

    def outer_schemes(self, config: Any, job: JobView) -> dict[str, QuantScheme]:
        """Modules outside the blocks that :meth:`final_tensors` writes quantized (full name -> scheme), for the
        checkpoint's ``quantization_config``."""
        return {}

    def log(self, config: Any, state: Any) -> dict[str, Any]:
        """Entries of the run log beyond the algorithm's options."""
        return {}

    # -- block level --
    def transform(self, config: Any, work: BlockWork) -> list[Any]:
        """Rewrite the float block in place on its calibration input; returns its records."""
        return []

    def transform_windows(self, config: Any) -> int | None:
        """How many leading calibration windows :meth:`transform` reads (None: every one). On several processes one
        of them transforms the block on those windows, gathered from all, and hands the block to the others."""
        return None

    def solve(self, config: Any, job: SolveJob) -> Solved:
        """A quantized weight and a record per linear of ``job`` (solvers only)."""
        raise NotImplementedError(f"{type(self).__name__} is not a weight solver")

    def companion(self, config: Any, work: BlockWork) -> Companion | None:
        """What runs beside the quantized block through its stages (target algorithms)."""
        return None

    def target_weights(self, config: Any, solver: Any, job: SolveJob, stage_data: Any) -> list[torch.Tensor]:
        """The weights the solver fits instead of ``job.weights`` (``solver``: its config; ``stage_data``: what
        this algorithm's companion collected over the stage)."""
        return job.weights

    def tune(self, config: Any, work: BlockWork) -> list[Any]:
        """Adjust the solved block (its weights and output) in place; returns its records."""
        return []
