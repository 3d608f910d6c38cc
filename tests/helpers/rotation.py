"""Folding rotations into a whole in-memory float model, for tests that compare it with the quantizer, which folds
them block by block (:func:`quantkit.rotation.fold.fold_block`) while it streams the model."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import get_module
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.rotation.config import rotations_for
from quantkit.rotation.fold import check_foldable, fold_block, rotate_embedding, rotate_head
from quantkit.rotation.norms import check_rmsnorm


def rotate_model(model: PreTrainedModel, arch: ArchSpec, config: RotationConfig) -> bool:
    """Fold ``config``'s rotations into an in-memory float model, in place. Returns whether the head had to be
    untied from the embedding (then ``model.config.tie_word_embeddings`` is now False and lm_head has its own
    parameter)."""
    rotations = rotations_for(config, model.config)
    if rotations.residual is None:
        return False
    final_norm = get_module(model, arch.final_norm_path)
    check_rmsnorm(final_norm, arch.final_norm_path)
    layers = list(get_module(model, arch.layers_path))
    for layer in layers:  # refuse before anything has changed
        check_foldable(layer, arch)
    embed, lm_head = get_module(model, arch.embed_path), get_module(model, arch.lm_head_path)
    tied = lm_head.weight is embed.weight or bool(getattr(model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        head_weight = rotate_head(lm_head.weight, final_norm.weight, rotations.residual)
        lm_head.weight = nn.Parameter(head_weight, requires_grad=lm_head.weight.requires_grad)
        embed.weight.copy_(rotate_embedding(embed.weight, rotations.residual))
        final_norm.weight.fill_(1.0)
    for layer in layers:
        fold_block(layer, arch, rotations.residual, rotations.head)
    if tied:
        model.config.tie_word_embeddings = False
    return tied
