"""The rotation config: validated kinds, stable names, and one matrix per role from one seed."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import tiny_llama_config

from quantkit.errors import QuantkitError
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.rotation.config import head_dim_of, rotations_for


def test_names_are_short_and_stable() -> None:
    assert RotationConfig("none").name == "none" and RotationConfig().name == "hadamard-s0"  # on when listed
    assert RotationConfig("hadamard").name == "hadamard-s0"
    assert RotationConfig("hadamard", seed=3, rotate_heads=False).name == "hadamard-s3-nohead"


def test_unknown_kind_is_refused_with_the_choices() -> None:
    with pytest.raises(QuantkitError, match=r"'spin'.*none, hadamard"):
        RotationConfig("spin")  # type: ignore[arg-type]


def test_none_gives_no_matrices() -> None:
    rotations = rotations_for(RotationConfig("none"), tiny_llama_config())
    assert rotations.residual is None and rotations.head is None


def test_hadamard_gives_residual_and_head_rotations_of_the_model_sizes() -> None:
    config = tiny_llama_config(hidden_size=64, num_attention_heads=1, num_key_value_heads=1)  # head_dim 64 too
    assert head_dim_of(config) == 64
    rotations = rotations_for(RotationConfig("hadamard", seed=1), config)
    assert rotations.residual.shape == rotations.head.shape == (64, 64)
    assert not torch.allclose(rotations.residual, rotations.head)  # seeds derived per role
    again = rotations_for(RotationConfig("hadamard", seed=1), config)
    assert torch.equal(again.residual, rotations.residual) and torch.equal(again.head, rotations.head)
    other = rotations_for(RotationConfig("hadamard", seed=2), config)
    assert not torch.allclose(other.residual, rotations.residual)
    assert rotations_for(RotationConfig("hadamard", rotate_heads=False), config).head is None


def test_explicit_head_dim_wins() -> None:
    config = tiny_llama_config(hidden_size=96, num_attention_heads=4, head_dim=16)
    assert head_dim_of(config) == 16
    assert rotations_for(RotationConfig("hadamard"), config).head.shape == (16, 16)
