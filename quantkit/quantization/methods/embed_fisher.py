"""The Fisher of the first residual stream: how much the model's output distribution moves when a token's embedding
row moves in each direction, the Hessian GPTQ solves the embedding under (``--embedding-solver gptq``).

A lookup has no input statistics, so round-to-nearest treats every direction of a row alike; but the blocks read
the residual stream unevenly, and the error of a row only matters through the KL it causes downstream. The Fisher
``E[g g^T]``, with ``g`` the gradient of ``log p(y)`` with respect to the first block's input and ``y`` drawn from the
float model's own distribution, is that KL's second-order term (its expectation is the Gauss-Newton matrix of the
KL), the same role ``2 X^T X`` plays for a linear.

The gradients come from a backward pass that holds one decoder block at a time: a chunk of windows is run forward
block by block keeping each block's input, the head's gradient is taken on the last output, and the blocks are
loaded again in reverse order, each recomputed from its kept input under autograd to pass the gradient down.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner, embed, get_module
from quantkit.model.source_weights import (
    SourceWeights,
    build_skeleton,
    config_json,
    head_is_tied,
    load_module,
    release_module,
)
from quantkit.progress import progress_bar

CHUNK_WINDOWS = 4  # windows run through the blocks together: their kept inputs are the memory this pass needs


def residual_fisher(
    source: Path,
    arch: ArchSpec,
    weights: SourceWeights,
    input_ids: torch.Tensor,
    forward_dtype: torch.dtype,
    *,
    seed: int = 0,
    show_progress: bool = True,
) -> torch.Tensor:
    """float64 [H, H]: the mean over the tokens of ``input_ids`` [n, T] of ``g g^T``, ``g`` the gradient of the
    log-likelihood of labels sampled from the float model (with ``seed``) with respect to the first block's input.
    Products run in ``forward_dtype`` (``--compute-dtype``); the sums in float64."""
    model = build_skeleton(source)
    layers = get_module(model, arch.layers_path)
    runner = BlockRunner.for_model(model, arch, int(input_ids.shape[1]), compute_dtype=forward_dtype)
    generator = torch.Generator().manual_seed(seed)
    first = _embedded(model, arch, weights, input_ids)  # every window's at once: one read of the table
    fisher: torch.Tensor | None = None
    count = 0
    with progress_bar(show_progress) as bar:
        task = bar.add_task("embedding Fisher", total=int(input_ids.shape[0]), unit="window")
        for start in range(0, int(input_ids.shape[0]), CHUNK_WINDOWS):
            windows = first[start : start + CHUNK_WINDOWS]
            kept = [windows]
            for index, layer in enumerate(layers):
                load_module(layer, f"{arch.layers_path}.{index}", weights)
                kept.append(runner.run(layer, kept[-1], out_dtype=torch.float32))
                release_module(layer)
            grad = _head_gradient(model, arch, source, weights, kept.pop(), runner, generator)
            for index in reversed(range(len(layers))):
                layer = layers[index]
                load_module(layer, f"{arch.layers_path}.{index}", weights)
                layer.requires_grad_(False)
                grad = _block_gradient(runner, layer, kept.pop(), grad)
                release_module(layer)
            rows = grad.reshape(-1, grad.shape[-1]).double()
            fisher = rows.T @ rows if fisher is None else fisher + rows.T @ rows
            count += rows.shape[0]
            bar.advance(task, windows.shape[0])
    assert fisher is not None, "no calibration windows"
    return fisher / count


def _embedded(model: nn.Module, arch: ArchSpec, weights: SourceWeights, ids: torch.Tensor) -> torch.Tensor:
    """The first block's input for ``ids`` (the embedding module as the model applies it, scale included)."""
    embedding = get_module(model, arch.embed_path)
    load_module(embedding, arch.embed_path, weights)
    hidden = embed(model, arch, ids, torch.float32)
    release_module(embedding)
    return hidden


def _block_gradient(runner: BlockRunner, layer: nn.Module, kept: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient at the block's input, given the gradient at its output, window by window."""
    out = torch.empty_like(kept)
    for i in range(kept.shape[0]):
        x = kept[i : i + 1].clone().requires_grad_(True)  # kept was made under inference_mode
        with torch.enable_grad(), runner.precision():
            y = runner.functional(layer, {}, x)
        (out[i : i + 1],) = torch.autograd.grad(y, x, grad_outputs=grad[i : i + 1].to(y.dtype))
    return out


def _head_gradient(
    model: nn.Module,
    arch: ArchSpec,
    source: Path,
    weights: SourceWeights,
    hidden: torch.Tensor,
    runner: BlockRunner,
    generator: torch.Generator,
) -> torch.Tensor:
    """The gradient of ``sum log p(y)`` at the last block's output, ``y`` drawn from the model's own prediction."""
    norm = get_module(model, arch.final_norm_path)
    load_module(norm, arch.final_norm_path, weights)
    norm.requires_grad_(False)
    head_name = f"{arch.lm_head_path}.weight"
    tied = head_is_tied(source, head_name, weights)
    head = weights.get(f"{arch.embed_path}.weight" if tied else head_name).to(runner.compute_dtype)
    cap = config_json(source).get("final_logit_softcapping")
    out = torch.empty_like(hidden)
    for i in range(hidden.shape[0]):  # a window at a time: the logits are [T, vocab]
        x = hidden[i : i + 1].clone().requires_grad_(True)
        with torch.enable_grad(), runner.precision():
            logits = functional.linear(norm(x), head).float()
            if cap:
                logits = float(cap) * torch.tanh(logits / float(cap))
            log_probs = torch.log_softmax(logits, dim=-1)
            labels = torch.multinomial(log_probs[0].detach().exp(), 1, generator=generator)
            (out[i : i + 1],) = torch.autograd.grad(log_probs[0].gather(1, labels).sum(), x)
    release_module(norm)
    return out
