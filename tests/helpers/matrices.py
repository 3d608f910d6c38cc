"""Matrices for the solver tests."""

from __future__ import annotations

import torch


def spd(k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * k, k, generator=gen) * (0.1 + torch.rand(k, generator=gen))
    h = 2.0 * x.T @ x / x.shape[0]
    h = torch.triu(h) + torch.triu(h, diagonal=1).T  # exactly symmetric, as HessianStat gives it
    h.diagonal().add_(0.01 * float(h.diagonal().mean()))
    return h
