"""Pure functions over logits: negative log-likelihood, KL divergence, top-1 agreement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of ``targets`` [..., T] under ``logits`` [..., T, V] (float64 out)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()


def token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token KL(reference || model) in nats, over the last (vocabulary) dimension (float64 out)."""
    ref = torch.log_softmax(reference_logits.float(), dim=-1)
    model = torch.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - model)).sum(-1, dtype=torch.float64).clamp_min(0.0)


@dataclass(slots=True)
class RunningMetrics:
    """Accumulates per-token statistics over evaluation windows."""

    nll_sum: float = 0.0
    tokens: int = 0
    kl_values: list[torch.Tensor] = field(default_factory=list)
    top1_matches: int = 0

    def add_nll(self, nll: torch.Tensor) -> None:
        self.nll_sum += float(nll.sum())
        self.tokens += nll.numel()

    def add_reference(self, reference_logits: torch.Tensor, logits: torch.Tensor) -> None:
        self.kl_values.append(token_kl(reference_logits, logits).flatten().float())
        self.top1_matches += int((reference_logits.argmax(-1) == logits.argmax(-1)).sum())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens) if self.tokens else float("nan")

    def kl_summary(self) -> tuple[float, float, float]:
        """(mean KL, 99th percentile KL, top-1 agreement rate)."""
        values = torch.cat(self.kl_values).double()
        return float(values.mean()), float(torch.quantile(values, 0.99)), self.top1_matches / values.numel()
