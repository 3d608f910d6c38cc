"""Hadamard matrices are exact, random rotations are orthogonal and reproducible per seed."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.rotation.hadamard import hadamard_matrix, has_hadamard, random_rotation

MODEL_SIZES = (12, 20, 28, 48, 64, 576, 1536, 896, 960)
REPO = Path(__file__).resolve().parents[2]
FALLBACK_SIZES = (9, 100)  # no Hadamard matrix known: 9 is odd, 100 = 4 * 25 needs a prime-power field


@pytest.mark.parametrize("n", MODEL_SIZES)
def test_hadamard_is_exact_for_model_sizes(n: int) -> None:
    h = hadamard_matrix(n)
    assert h.dtype == torch.float64 and h.shape == (n, n)
    assert bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_every_constructible_order_up_to_256_is_exact() -> None:
    """Sylvester, Paley I (q % 4 == 3), Paley II (q % 4 == 1) and their Kronecker products alike."""
    orders = [n for n in range(1, 257) if has_hadamard(n)]
    assert {1, 2, 4, 12, 20, 28, 36, 60, 96, 108} <= set(orders)  # 28, 36, 108: Paley II (q = 13, 17, 53)
    for n in orders:
        h = hadamard_matrix(n)
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)), n


def test_large_model_sizes_are_constructible() -> None:
    assert all(has_hadamard(n) for n in (128, 2048, 3072, 3584, 4096, 5120))
    assert not any(has_hadamard(n) for n in (3, 6, 9, 100))


def test_unconstructible_order_names_the_fallback() -> None:
    with pytest.raises(QuantkitError, match=r"order 9 .*random_rotation"):
        hadamard_matrix(9)


@pytest.mark.parametrize("n", MODEL_SIZES + FALLBACK_SIZES)
def test_random_rotation_is_orthogonal(n: int) -> None:
    q = random_rotation(n, seed=1)
    assert q.dtype == torch.float64 and q.shape == (n, n)
    assert (q @ q.T - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-12


def test_random_rotation_is_randomized_hadamard_when_one_exists() -> None:
    q = random_rotation(48, seed=0)
    assert torch.allclose(q.abs(), torch.full((48, 48), 48**-0.5, dtype=torch.float64), rtol=0, atol=1e-15)
    assert not torch.equal(q * 48**0.5, hadamard_matrix(48))  # the signs are random


@pytest.mark.parametrize("n", (48, 100))
def test_random_rotation_depends_only_on_the_seed(n: int) -> None:
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    first = random_rotation(n, seed=5)
    assert torch.equal(torch.rand(1), before)  # the global RNG is not used
    assert torch.equal(random_rotation(n, seed=5), first)
    assert not torch.allclose(random_rotation(n, seed=6), first)


def _digest(n: int, seed: int) -> str:
    return hashlib.sha256(random_rotation(n, seed).numpy().tobytes()).hexdigest()


def test_random_rotation_is_the_same_in_another_process() -> None:
    code = "from tests.rotation.test_hadamard import _digest; print(_digest(48, 7), _digest(100, 7))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert there.stdout.split() == [_digest(48, 7), _digest(100, 7)]
