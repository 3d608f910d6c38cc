"""Refit the float head to the quantized body (``--refit-head``): after the last block, an H x H linear map ``A``
that best carries the quantized model's final hidden states onto the float model's (ridge regression over
every calibration token) is folded into the head, ``head' = head @ A^T``, so the head reads the quantized
residual stream as the float head reads the float one. The head stays a float matrix of the same shape; nothing
changes at inference.

Least squares on the hidden states is least squares on the logits: for the full-rank map the solution of
``min ||Hq A W^T - Hf W^T||`` does not depend on ``W``. It needs a head of its own: an untied one, or the one a
rotation unties (a head tied to the embedding would change the inputs too).

Measured on SmolLM2-135M (rotated, GPTQ, tuned; 64 x 512 calibration windows, 40 held-out windows): at W4 g64
KL 0.061 -> 0.059 and perplexity +2.6% -> +2.2%, at W3 g64 KL 0.182 -> 0.175 and +12.2% -> +11.1%. The ridge,
1e-4 of the Gram matrix's mean diagonal, was chosen on an earlier W4 checkpoint: KL 0.0608 there against 0.0614
for 1e-3; 1e-2 made it worse than no refit (0.0782 against 0.0629).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantkit.errors import QuantkitError
from quantkit.model.source_weights import config_json

if TYPE_CHECKING:
    from quantkit.quantization.job import QuantizeJob
    from quantkit.quantization.workdir import WorkDir

# Ridge added to the Gram matrix, relative to its mean diagonal (see the module docstring).
HEAD_RIDGE = 1e-4


def final_hidden(stream: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 [tokens, H]: the final RMSNorm of a residual stream [..., H] (what the head reads)."""
    x = stream.reshape(-1, stream.shape[-1]).float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * norm_weight.float()


def refit_head(
    head: torch.Tensor,
    quantized: torch.Tensor,
    reference: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    ridge: float = HEAD_RIDGE,
) -> torch.Tensor:
    """The head [V, H] refitted to read the quantized stream ``quantized`` [n, T, H] (the last block's output) as
    ``head`` reads the float stream ``reference`` on the same windows; returned in ``head``'s dtype."""
    if quantized.shape != reference.shape:
        raise ValueError(f"streams {tuple(quantized.shape)} and {tuple(reference.shape)} must pair tokens")
    size = head.shape[1]
    gram = torch.zeros(size, size, dtype=torch.float64)
    cross = torch.zeros(size, size, dtype=torch.float64)
    for q, f in zip(quantized, reference, strict=True):  # a window at a time, summed in float64
        hq, hf = final_hidden(q.cpu(), norm_weight.cpu(), eps), final_hidden(f.cpu(), norm_weight.cpu(), eps)
        gram += (hq.T @ hq).double()
        cross += (hq.T @ hf).double()
    damp = ridge * float(gram.diagonal().mean())
    mapping = torch.linalg.solve(gram + damp * torch.eye(size, dtype=torch.float64), cross)
    return (head.float().cpu() @ mapping.T.float()).to(head.dtype)


def check_refittable(model: str, tied: bool) -> None:
    """``--refit-head`` without a rotation needs the source's head to be its own (a rotation unties it)."""
    if tied:
        raise QuantkitError(
            f"--refit-head needs an untied head, and '{model}' ties its head to the embedding; "
            "add --rotate hadamard (which unties it) or drop --refit-head"
        )


def refitted_head(job: QuantizeJob, work: WorkDir, outer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head tensor to write, refitted to the finished run's last activations (computed from the run's own
    head each time, so a resumed run writes the same head)."""
    arch = job.arch
    head_name, norm_name = f"{arch.lm_head_path}.weight", f"{arch.final_norm_path}.weight"
    head = outer[head_name] if head_name in outer else job.weights.get(head_name)
    norm = outer[norm_name] if norm_name in outer else job.weights.get(norm_name)
    reference = work.load_reference()
    if reference is None:
        raise QuantkitError(f"{work.path} has no float activations to refit the head to; rerun without --resume")
    eps = float(config_json(job.source).get("rms_norm_eps", 1e-6))
    return {head_name: refit_head(head, work.load_hidden(), reference, norm, eps)}
