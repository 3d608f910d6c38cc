"""The matrices a rotation stands for."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, get_args

import torch

from quantkit.rotation.hadamard import random_rotation

if TYPE_CHECKING:
    from transformers import PretrainedConfig

RotationKind = Literal["none", "hadamard"]
ROTATION_KINDS: tuple[str, ...] = get_args(RotationKind)


class RotationSpec(Protocol):
    """Which rotation (``quantization/methods/rotation.py`` holds it, with its defaults)."""

    kind: str  # one of ROTATION_KINDS
    seed: int
    rotate_heads: bool


@dataclass(slots=True, frozen=True)
class Rotations:
    """The orthogonal float64 matrices to fold: ``residual`` [hidden, hidden], ``head`` [head_dim, head_dim]."""

    residual: torch.Tensor | None
    head: torch.Tensor | None


def _derived_seed(seed: int, role: str) -> int:
    """A seed per matrix, stable across processes (crc32, not Python's salted hash)."""
    return zlib.crc32(f"{seed}:{role}".encode())


def head_dim_of(model_config: PretrainedConfig) -> int:
    """The attention head size: ``head_dim`` when the config sets it, else hidden / heads."""
    head_dim = getattr(model_config, "head_dim", None)
    return int(head_dim) if head_dim else model_config.hidden_size // model_config.num_attention_heads


def rotations_for(config: RotationSpec, model_config: PretrainedConfig) -> Rotations:
    """The residual and head rotations ``config`` gives for a model's config."""
    if config.kind == "none":
        return Rotations(residual=None, head=None)
    residual = random_rotation(model_config.hidden_size, _derived_seed(config.seed, "residual"))
    head = (
        random_rotation(head_dim_of(model_config), _derived_seed(config.seed, "head")) if config.rotate_heads else None
    )
    return Rotations(residual=residual, head=head)
