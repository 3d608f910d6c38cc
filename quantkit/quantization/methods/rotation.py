"""Rotations in the layer-by-layer run (``--rotate``): the job's matrices, checked once before any work, each
block folded as it is loaded, and the tensors outside the blocks (embedding, final norm, head) rotated once.

The outer tensors are computed at the start of a run and kept in the work directory, so the calibration
inputs (rows of the rotated embedding) and the checkpoint use the very same values, and a resumed run reuses
them. A model whose head is tied to its embedding gets a separate head: the final norm's weight is folded into
the head but not into the embedding, so the two matrices differ after rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from quantkit.errors import QuantkitError
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import get_module
from quantkit.model.source_weights import SourceWeights, build_skeleton, head_is_tied, load_module, release_module
from quantkit.quantization.methods.hooks import Hooks, JobView
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.rotation.config import ROTATION_KINDS, RotationKind, Rotations, rotations_for
from quantkit.rotation.fold import check_foldable, fold_block, head_rotation_refusal, rotate_embedding, rotate_head
from quantkit.rotation.norms import check_rmsnorm, unit_weight

OFF = "none"


@dataclass(slots=True, frozen=True)
class RotationConfig:
    """``kind`` "hadamard" folds a randomized Hadamard rotation into the residual stream and (with
    ``rotate_heads``) one per attention head between v_proj and o_proj, left out where the architecture gates the
    attention output before o_proj (Qwen3.5; the run log says so); "none" leaves the model as it is."""

    kind: RotationKind = option(
        "hadamard", f"Rotation folded into the weights before solving: {', '.join(ROTATION_KINDS)}.", flag="--rotate"
    )
    seed: int = option(0, "Seed of the rotation's random signs.", flag="--rotate-seed")
    rotate_heads: bool = option(True, "Also rotate each attention head between v_proj and o_proj.", cli=False)

    def __post_init__(self) -> None:
        if self.kind not in ROTATION_KINDS:
            raise QuantkitError(f"unknown rotation kind {self.kind!r}; use one of: {', '.join(ROTATION_KINDS)}")

    @property
    def name(self) -> str:
        """Short and stable, for file names: "none", "hadamard-s0", "hadamard-s0-nohead"."""
        if self.kind == OFF:
            return OFF
        return f"{self.kind}-s{self.seed}" + ("" if self.rotate_heads else "-nohead")


@dataclass(slots=True)
class JobRotation:
    config: RotationConfig  # as run: rotate_heads off where the architecture's heads cannot rotate
    matrices: Rotations
    arch: ArchSpec
    tied: bool  # the source ties its head to the embedding: the checkpoint gets an untied head
    heads_skipped: str | None = None  # why the head rotation asked for was left out

    def fold(self, block: nn.Module, index: int | None = None) -> None:
        """Fold the rotations into one loaded float block, in place. ``index``: the block's layer (a hybrid model's
        layers differ in their token mixer, ``ArchSpec.for_layer``); None only where every layer is alike."""
        assert self.matrices.residual is not None
        arch = self.arch if index is None else self.arch.for_layer(index)
        fold_block(block, arch, self.matrices.residual, self.matrices.head)

    @property
    def embed_name(self) -> str:
        return f"{self.arch.embed_path}.weight"

    @property
    def head_name(self) -> str:
        return f"{self.arch.lm_head_path}.weight"

    def log(self) -> dict[str, object]:
        """What the run log records about the rotation."""
        config = self.config
        return {"kind": config.kind, "seed": config.seed, "rotate_heads": config.rotate_heads} | (
            {"heads_skipped": self.heads_skipped} if self.heads_skipped else {}
        )

    def outer_tensors(self, weights: SourceWeights, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The rotated embedding, the head with the final norm folded in, and the final norm set to multiply by one
        (ones; zeros where the norm multiplies by 1 + w); ``dtype``: the source tensors are cast to it first (GGUF
        output rotates in float32, as it quantizes them once more)."""
        residual = self.matrices.residual
        assert residual is not None
        norm_name = f"{self.arch.final_norm_path}.weight"

        def get(name: str) -> torch.Tensor:
            tensor = weights.get(name)
            return tensor if dtype is None else tensor.to(dtype)

        embed, norm = get(self.embed_name), get(norm_name)
        head = embed if self.head_name not in weights else get(self.head_name)
        return {
            self.embed_name: rotate_embedding(embed, residual),
            self.head_name: rotate_head(head, norm, residual, self.arch.norm_offset),
            norm_name: torch.full_like(norm, unit_weight(self.arch.norm_offset)),
        }

    def embed_inputs(self, outer: dict[str, torch.Tensor], input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The first block's input: rows of the rotated embedding, exactly as the checkpoint stores them."""
        return functional.embedding(input_ids, outer[self.embed_name]).to(dtype)


def job_rotation(config: RotationConfig, source: Path, arch: ArchSpec, weights: SourceWeights) -> JobRotation:
    """The rotation of a job, checked against the model before any work: the final norm and the first block of each
    layer kind must fold, or a QuantkitError names the module that blocks it. Where the architecture's heads cannot
    rotate (a gated attention output), the head rotation is left out and the reason kept for the run log."""
    heads_skipped = head_rotation_refusal(arch) if config.rotate_heads else None
    if heads_skipped is not None:
        config = replace(config, rotate_heads=False)
    skeleton = build_skeleton(source)
    matrices = rotations_for(config, skeleton.config)
    final_norm = get_module(skeleton, arch.final_norm_path)
    load_module(final_norm, arch.final_norm_path, weights)
    check_rmsnorm(final_norm, arch.final_norm_path, arch.norm_offset)
    layers = get_module(skeleton, arch.layers_path)
    firsts = {_layer_kind(arch, i): i for i in reversed(range(len(layers)))}  # each kind's first layer
    for index in sorted(firsts.values()):
        path = f"{arch.layers_path}.{index}"
        block = get_module(skeleton, path)
        load_module(block, path, weights)
        check_foldable(block, arch.for_layer(index))
        release_module(block)
    tied = head_is_tied(source, f"{arch.lm_head_path}.weight", weights)
    return JobRotation(config, matrices, arch, tied=tied, heads_skipped=heads_skipped)


def rotate_loaded_model(model: nn.Module, rotation: JobRotation, outer: dict[str, torch.Tensor]) -> None:
    """Fold ``rotation`` into a whole loaded float model, in place, as a run folds it block by block: every decoder
    block, then ``outer`` (:meth:`JobRotation.outer_tensors`) as the embedding, the final norm and a head of its own
    (a tied head becomes a separate parameter, and the config says so, as the checkpoint would)."""
    arch = rotation.arch
    for index, block in enumerate(get_module(model, arch.layers_path)):
        rotation.fold(block, index)
    for name, tensor in outer.items():
        module = get_module(model, name.rpartition(".")[0])
        current = module.weight
        module.weight = nn.Parameter(tensor.to(current.device, current.dtype), requires_grad=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False


def _layer_kind(arch: ArchSpec, index: int) -> str:
    return arch.layer_kinds[index] if arch.mixers else ""


class _Hooks(Hooks):
    def prepare(self, config: Any, job: JobView) -> JobRotation:
        return job_rotation(config, job.source, job.arch, job.weights)

    def outer_tensors(self, state: Any, job: JobView) -> dict[str, torch.Tensor]:
        return state.outer_tensors(job.weights)

    def first_input(
        self, state: Any, outer: dict[str, torch.Tensor], input_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return state.embed_inputs(outer, input_ids, dtype)

    def residual_basis(self, state: Any) -> torch.Tensor | None:
        return state.matrices.residual

    def fold(self, state: Any, block: nn.Module, index: int) -> None:
        state.fold(block, index)

    def log(self, config: Any, state: Any) -> dict[str, Any]:
        return {"rotation": state.log() | {"untied_head": state.head_name if state.tied else None}}


SWITCH = Switch("field", field="kind", off=OFF)
CAPS = Capabilities(needs_calibration=False, loads_float32=True, unties_head=True)
SUMMARY = "rotation: a randomized Hadamard rotation folded into the float weights (QuaRot-style)"
ALGORITHM = register("rotation", RotationConfig, Role.ROTATION, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
