"""Hadamard matrices (Sylvester and Paley constructions, combined by Kronecker products) and random rotations.

An order n is built as ``core ⊗ Sylvester(2^k)`` with the largest power of two possible, the core being a
product of Paley matrices: 576 = Paley II(q=17, order 36) ⊗ Sylvester(16) and 1536 = Paley I(q=11, order 12) ⊗
Sylvester(128).
"""

from __future__ import annotations

import math
from functools import cache

import torch

from quantkit.errors import QuantkitError

_SYLVESTER_2 = ((1.0, 1.0), (1.0, -1.0))


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _paley_kind(order: int) -> int | None:
    """1 or 2 when a Paley construction I or II gives a Hadamard matrix of this order, else None."""
    if _is_prime(order - 1) and (order - 1) % 4 == 3:
        return 1
    if order % 2 == 0 and _is_prime(order // 2 - 1) and (order // 2 - 1) % 4 == 1:
        return 2
    return None


@cache  # functools.lru_cache without a size bound
def _paley_factors(core: int) -> tuple[int, ...] | None:
    """Paley orders whose product is ``core`` (smallest first factor that works), or None."""
    if core == 1:
        return ()
    for order in range(4, core + 1):
        if core % order == 0 and _paley_kind(order) is not None:
            rest = _paley_factors(core // order)
            if rest is not None:
                return (order, *rest)
    return None


@cache  # functools.lru_cache without a size bound
def _factorization(n: int) -> tuple[tuple[int, ...], int] | None:
    """(Paley orders, power of two) with product n, keeping the power of two as large as possible."""
    if n < 1:
        return None
    twos = (n & -n).bit_length() - 1  # exponent of 2 in n
    for k in range(twos, -1, -1):
        factors = _paley_factors(n >> k)
        if factors is not None:
            return factors, 1 << k
    return None


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = Legendre symbol of (j - i) mod q."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley(order: int) -> torch.Tensor:
    kind = _paley_kind(order)
    q = order - 1 if kind == 1 else order // 2 - 1
    f64 = torch.float64
    # S = [[0, 1^T], [∓1, Q]]: antisymmetric for construction I (q % 4 == 3), symmetric for II (q % 4 == 1)
    ones = torch.ones(q, 1, dtype=f64)
    top = torch.cat([torch.zeros(1, 1, dtype=f64), ones.T], dim=1)
    s = torch.cat([top, torch.cat([(-1.0 if kind == 1 else 1.0) * ones, _jacobsthal(q)], dim=1)])
    if kind == 1:
        return torch.eye(q + 1, dtype=f64) + s
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=f64)
    return torch.kron(s, a) + torch.kron(torch.eye(q + 1, dtype=f64), torch.tensor(_SYLVESTER_2, dtype=f64))


def _sylvester(order: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor(_SYLVESTER_2, dtype=torch.float64)
    while h.shape[0] < order:
        h = torch.kron(h, base)
    return h


def has_hadamard(n: int) -> bool:
    """Whether ``hadamard_matrix(n)`` can build a Hadamard matrix of order n."""
    return _factorization(n) is not None


def hadamard_matrix(n: int) -> torch.Tensor:
    """An unnormalized Hadamard matrix of order n: float64 entries ±1 with H @ H.T == n * I."""
    found = _factorization(n)
    if found is None:
        raise QuantkitError(
            f"no Hadamard matrix of order {n} can be built from Sylvester and Paley (prime q) constructions; "
            "check has_hadamard(n) first, or use random_rotation(n, seed), which falls back to a random orthogonal "
            "factor"
        )
    paley_orders, power_of_two = found
    h = torch.ones(1, 1, dtype=torch.float64)
    for order in paley_orders:
        h = torch.kron(h, _paley(order))
    return torch.kron(h, _sylvester(power_of_two))


def _random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """Haar-random orthogonal matrix: QR of a Gaussian, columns signed so that R has a positive diagonal."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).contiguous()


def _random_hadamard(n: int, generator: torch.Generator) -> torch.Tensor:
    """hadamard_matrix(n) @ diag(random ±1) / sqrt(n): orthogonal."""
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
    return hadamard_matrix(n) * signs[None, :] / math.sqrt(n)


def random_rotation(n: int, seed: int) -> torch.Tensor:
    """An orthogonal float64 [n, n] matrix, the same for a given (n, seed) in every process: a randomized
    Hadamard matrix, or when none of order n is known, the Kronecker product of one for n's largest
    Hadamard-constructible divisor and a random orthogonal matrix for the rest."""
    if n < 1:
        raise QuantkitError(f"a rotation needs a positive size, got {n}; pass the model's hidden size or head dim")
    generator = torch.Generator().manual_seed(seed)
    if has_hadamard(n):
        return _random_hadamard(n, generator)
    part = max(d for d in range(1, n + 1) if n % d == 0 and has_hadamard(d))
    return torch.kron(_random_hadamard(part, generator), _random_orthogonal(n // part, generator))
