"""Folding rotations into a whole in-memory float model, for tests that compare it with the quantizer, which folds
them block by block (:func:`quantkit.rotation.fold.fold_block`) while it streams the model."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import PreTrainedModel

from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import get_module
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.rotation.config import rotations_for
from quantkit.rotation.fold import check_foldable, fold_block, head_rotation_refusal, rotate_embedding, rotate_head
from quantkit.rotation.norms import check_rmsnorm, unit_weight


def rotate_model(model: PreTrainedModel, arch: ArchSpec, config: RotationConfig) -> bool:
    """Fold ``config``'s rotations into an in-memory float model, in place (``arch``: the model's spec, as
    ``arch_for_config`` gives it; each layer folds under ``arch.for_layer``; the head rotation is left out where the
    architecture refuses it, as the quantizer does). Returns whether the head had to be untied from the embedding
    (then ``model.config.tie_word_embeddings`` is now False and lm_head has its own parameter)."""
    if config.rotate_heads and head_rotation_refusal(arch) is not None:
        config = replace(config, rotate_heads=False)
    rotations = rotations_for(config, model.config)
    if rotations.residual is None:
        return False
    final_norm = get_module(model, arch.final_norm_path)
    check_rmsnorm(final_norm, arch.final_norm_path, arch.norm_offset)
    layers = list(get_module(model, arch.layers_path))
    for index, layer in enumerate(layers):  # refuse before anything has changed
        check_foldable(layer, arch.for_layer(index))
    embed, lm_head = get_module(model, arch.embed_path), get_module(model, arch.lm_head_path)
    tied = lm_head.weight is embed.weight or bool(getattr(model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        head_weight = rotate_head(lm_head.weight, final_norm.weight, rotations.residual, arch.norm_offset)
        lm_head.weight = nn.Parameter(head_weight, requires_grad=lm_head.weight.requires_grad)
        embed.weight.copy_(rotate_embedding(embed.weight, rotations.residual))
        final_norm.weight.fill_(unit_weight(arch.norm_offset))
    for index, layer in enumerate(layers):
        fold_block(layer, arch.for_layer(index), rotations.residual, rotations.head)
    if tied:
        model.config.tie_word_embeddings = False
    return tied
