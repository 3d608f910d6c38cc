"""A rotation folded into a GGUF solve (``--rotate hadamard`` with ``--format gguf:<MIX>``).

The folding is the compressed-tensors pipeline's (:mod:`quantkit.quantization.methods.rotation`): the block norms
go into the linears that read them and become ones, the residual stream is rotated (each block's readers and
writers as it is loaded, the embedding once) with a per-head rotation between v_proj and o_proj, and the final
norm goes into the head, which is then a matrix of its own even when the source ties it to the embedding. What
llama.cpp reads is a plain Llama file: the rotated weights, norms of ones, and an ``output.weight``.

Here everything outside the blocks is rotated in float32 (a bfloat16 source is widened first), because the GGUF
types quantize it once more; the blocks are folded in the float32 in which the block walk loads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quantkit.model.architectures import ArchSpec
from quantkit.model.source_weights import SourceWeights
from quantkit.quantization.methods.rotation import OFF, JobRotation, job_rotation


@dataclass(slots=True)
class GGUFRotation:
    job: JobRotation
    outer: dict[str, torch.Tensor]  # HF name -> float32: rotated embedding, head (final norm in it), norm of ones

    def fold(self, block: nn.Module, index: int) -> None:
        """Fold the rotation into the loaded float block of layer ``index``, in place (before its Hessians are
        taken)."""
        self.job.fold(block, index)

    def take(self, hf_name: str, weights: SourceWeights) -> torch.Tensor:
        """A tensor outside the blocks as the rotated model holds it (the source's own when not rotated), handed
        over once: the run does not keep an embedding-sized matrix it has solved."""
        return self.outer.pop(hf_name) if hf_name in self.outer else weights.get(hf_name).float()

    def dense_of(self, block: nn.Module, prefix: str, hf_names: list[str]) -> dict[str, np.ndarray]:
        """The folded block's own values of its dense tensors (norms of ones, rotated biases), by HF name."""
        out = {}
        for name in hf_names:
            param = block.get_parameter(name.removeprefix(f"{prefix}."))
            out[name] = param.detach().float().cpu().numpy()
        return out


def gguf_rotation(config: Any, source: Path, arch: ArchSpec, weights: SourceWeights) -> GGUFRotation | None:
    """The run's rotation (``config``: a RotationConfig, or None), checked against the model before any work; None
    when there is none to fold."""
    if config is None or config.kind == OFF:
        return None
    job = job_rotation(config, source, arch, weights)
    return GGUFRotation(job, job.outer_tensors(weights, dtype=torch.float32))
