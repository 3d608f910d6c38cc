"""Refit the float head to the quantized body: after the last block, an H x H linear map ``A``
that best carries the quantized model's final hidden states onto the float model's (ridge regression over
every calibration token) is folded into the head, ``head' = head @ A^T``, so the head reads the quantized
residual stream as the float head reads the float one. The head stays a float matrix of the same shape; nothing
changes at inference.

Least squares on the hidden states is least squares on the logits: for the full-rank map the solution of
``min ||Hq A W^T - Hf W^T||`` does not depend on ``W``. It needs a head of its own: an untied one, or the one a
rotation unties (a head tied to the embedding would change the inputs too).

The figures (with and without the refit, and the ridge sweep) are in docs/benchmarks.md.
"""

from __future__ import annotations

import torch


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
    ridge: float,
) -> torch.Tensor:
    """The head [V, H] refitted to read the quantized stream ``quantized`` [n, T, H] (the last block's output) as
    ``head`` reads the float stream ``reference`` on the same windows; returned in ``head``'s dtype. ``ridge``:
    added to the Gram matrix, relative to its mean diagonal."""
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
