"""``--float-targets`` in a GGUF solve: each linear's K-quant GPTQ fits the float model's outputs, not its own.

The target is the compressed-tensors pipeline's (:mod:`quantkit.quantization.methods.float_targets`, GPTAQ plus
the residual stream's error): GPTQ runs on ``W* = W + shift (H + lambda I)^-1`` with the stage's usual Hessian
``H`` of the quantized inputs, on the linear's own GGML grid. What it needs is the float model's stream beside the
quantized one, which :class:`FloatStream` carries block by block:

- it starts at the float embedding's rows (the rotated float embedding under ``--rotate``), while the quantized
  stream starts at the quantized embedding's, so the first block's first stage already corrects the embedding's
  rounding (with an embedding kept in float the two agree there and the target is ``W``);
- each block's :class:`~quantkit.quantization.methods.float_targets.FloatCompanion` is built from the block as
  loaded, after a rotation is folded in and before any of its linears is quantized, and runs stage by stage
  beside the quantized block in :func:`~quantkit.quantization.block_loop.stage_hessians`;
- the block's float output, computed on the way, is the next block's float input.

The solver's loss (the run's ``loss`` per tensor) is then ``tr((W* - Q) H (W* - Q)^T)`` with GPTQ's damped ``H``:
the part of the float-output error ``sum ||W x - e - Q x~||^2`` that depends on ``Q`` (the rest is the target's own
residual, the same for every ``Q``), not the distance to the source weight.

Memory: one float copy of the block being solved and one more hidden stream [windows, seq, hidden].
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner
from quantkit.quantization.methods.composition import JobSteps
from quantkit.quantization.methods.float_targets import (
    FloatCompanion,
    FloatPath,
    FloatTargetsConfig,
    StageMoments,
    float_target,
)
from quantkit.quantization.methods.gptq import GPTQConfig
from quantkit.quantization.methods.registry import by_name
from quantkit.quantization.solvers.gptq import GPTQSettings


def check_float_targets(method: str) -> None:
    """Refuse float targets with a solver they do not work with, in the compressed-tensors path's words (the
    composition's check of the algorithm's ``requires``: GPTQ)."""
    JobSteps([by_name(method).config(), FloatTargetsConfig()])


class FloatStream:
    """The float model's hidden stream beside the quantized one, and the targets it gives each linear."""

    def __init__(self, reference: torch.Tensor, targets: FloatTargetsConfig, gptq: GPTQSettings | None = None) -> None:
        self.reference: torch.Tensor | None = reference  # [windows, seq, hidden]: the float input of the next block
        # GPTQ's relative damping (its default when the run names no settings) plus the targets' ridge, as the
        # compressed-tensors path damps them
        self.damp = float((gptq or GPTQConfig()).damp) + targets.ridge

    def companion(self, block: nn.Module, arch: ArchSpec, runner: BlockRunner) -> FloatCompanion:
        """The float path of ``block`` (float weights: call before any of its linears is overwritten), on the
        block's float input; the stream holds nothing more until :meth:`advance`."""
        assert self.reference is not None, "advance() the stream after each block"
        companion = FloatCompanion(FloatPath(block, arch, runner, self.reference))  # it keeps its own copy
        self.reference = None
        return companion

    def target(self, name: str, weight: torch.Tensor, hessian: torch.Tensor, moments: StageMoments) -> torch.Tensor:
        """The weight GPTQ solves for the linear ``name`` (its float ``weight``) on the stage's ``hessian``."""
        if moments.count == 0:  # no calibration row: nothing to fit, the weight itself
            return weight
        return float_target(weight, hessian, moments.shift(name, weight), self.damp)

    def advance(self, companion: FloatCompanion) -> None:
        """After the block's last stage: its float output is the next block's float input."""
        self.reference = companion.float_output()
