"""Which rotation to fold into a model, and the matrices it stands for."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import torch

from quantkit.errors import QuantkitError
from quantkit.rotation.hadamard import random_rotation

if TYPE_CHECKING:
    from transformers import PretrainedConfig

RotationKind = Literal["none", "hadamard"]
ROTATION_KINDS: tuple[str, ...] = get_args(RotationKind)


@dataclass(slots=True, frozen=True)
class RotationConfig:
    """``kind`` "none" leaves the model as it is; "hadamard" folds a randomized Hadamard rotation into the
    residual stream and (with ``rotate_heads``) one per attention head between v_proj and o_proj."""

    kind: RotationKind = "none"
    seed: int = 0
    rotate_heads: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROTATION_KINDS:
            raise QuantkitError(f"unknown rotation kind {self.kind!r}; use one of: {', '.join(ROTATION_KINDS)}")

    @property
    def name(self) -> str:
        """Short and stable, for fingerprints and file names: "none", "hadamard-s0", "hadamard-s0-nohead"."""
        if self.kind == "none":
            return "none"
        return f"{self.kind}-s{self.seed}" + ("" if self.rotate_heads else "-nohead")


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


def rotations_for(config: RotationConfig, model_config: PretrainedConfig) -> Rotations:
    """The residual and head rotations ``config`` gives for a model's config."""
    if config.kind == "none":
        return Rotations(residual=None, head=None)
    residual = random_rotation(model_config.hidden_size, _derived_seed(config.seed, "residual"))
    head = (
        random_rotation(head_dim_of(model_config), _derived_seed(config.seed, "head")) if config.rotate_heads else None
    )
    return Rotations(residual=residual, head=head)
