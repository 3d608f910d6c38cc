"""Pure functions over logits: negative log-likelihood, KL divergence, top-1 agreement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Positions whose full-vocabulary log-probabilities are formed at once by RunningMetrics.add_window: a few
# [128, V] float32 temporaries (25 MB each at SmolLM2's V = 49,152) however long the window is.
CHUNK_POSITIONS = 128


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of ``targets`` [..., T] under ``logits`` [..., T, V] (float64 out)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()


def token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token KL(reference || model) in nats, over the last (vocabulary) dimension (float64 out)."""
    ref = torch.log_softmax(reference_logits.float(), dim=-1)
    model = torch.log_softmax(logits.float(), dim=-1)
    return _kl_of_logprobs(ref, model)


def _kl_of_logprobs(ref: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    return (ref.exp() * (ref - model)).sum(-1, dtype=torch.float64).clamp_min(0.0)


def _nll_of_logprobs(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()


@dataclass(slots=True)
class WindowSums:
    """One window's sums over its scored tokens: the model's NLL and, against a reference, the reference's NLL,
    the KL divergence and the top-1 matches."""

    tokens: int
    nll: float = 0.0
    reference_nll: float = 0.0
    kl: float = 0.0
    top1: int = 0


@dataclass(slots=True)
class RunningMetrics:
    """Accumulates per-token statistics over evaluation windows: sums and counts, plus one float32 KL value per
    scored token (for the 99th percentile), never logits."""

    nll_sum: float = 0.0
    tokens: int = 0
    reference_nll_sum: float = 0.0  # the reference model's NLL over the same tokens (add_window only)
    reference_tokens: int = 0
    kl_values: list[torch.Tensor] = field(default_factory=list)
    top1_matches: int = 0
    # per window (add_window only), for standard errors over windows and paired comparisons: tokens within a
    # window are correlated, windows far less, so a window is the unit of the noise estimate
    windows: list[WindowSums] = field(default_factory=list)

    def add_nll(self, nll: torch.Tensor) -> None:
        self.nll_sum += float(nll.sum())
        self.tokens += nll.numel()

    def add_reference(self, reference_logits: torch.Tensor, logits: torch.Tensor) -> None:
        self.kl_values.append(token_kl(reference_logits, logits).flatten().float())
        self.top1_matches += int((reference_logits.argmax(-1) == logits.argmax(-1)).sum())

    def add_window(
        self, logits: torch.Tensor, targets: torch.Tensor, reference_logits: torch.Tensor | None = None
    ) -> None:
        """One window's scored positions: ``logits`` [T, V] predict ``targets`` [T]; with ``reference_logits``
        [T, V], also the reference's NLL, KL(reference || model) and top-1 agreement.

        Works through CHUNK_POSITIONS positions at a time, each log-softmax formed once and shared by the NLL
        and the KL, so the temporaries stay a few chunk-sized tensors. Log-softmax is per position, so the
        figures equal those of token_nll/token_kl over the whole window (up to float64 summation order).
        """
        sums = WindowSums(tokens=int(targets.shape[0]))
        for start in range(0, targets.shape[0], CHUNK_POSITIONS):
            end = start + CHUNK_POSITIONS
            target = targets[start:end]
            logprobs = torch.log_softmax(logits[start:end].float(), dim=-1)
            nll = _nll_of_logprobs(logprobs, target)
            sums.nll += float(nll.sum())
            self.nll_sum += float(nll.sum())
            self.tokens += nll.numel()
            if reference_logits is None:
                continue
            reference = torch.log_softmax(reference_logits[start:end].float(), dim=-1)
            reference_nll = float(_nll_of_logprobs(reference, target).sum())
            sums.reference_nll += reference_nll
            self.reference_nll_sum += reference_nll
            self.reference_tokens += nll.numel()
            kl = _kl_of_logprobs(reference, logprobs)
            sums.kl += float(kl.sum())
            self.kl_values.append(kl.float())
            agree = int((reference_logits[start:end].argmax(-1) == logits[start:end].argmax(-1)).sum())
            sums.top1 += agree
            self.top1_matches += agree
        self.windows.append(sums)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens) if self.tokens else float("nan")

    @property
    def reference_perplexity(self) -> float | None:
        """The reference's perplexity over the same tokens; None when no reference was scored."""
        return math.exp(self.reference_nll_sum / self.reference_tokens) if self.reference_tokens else None

    def kl_summary(self) -> tuple[float, float, float]:
        """(mean KL, 99th percentile KL, top-1 agreement rate)."""
        values = torch.cat(self.kl_values).double()
        return float(values.mean()), float(torch.quantile(values, 0.99)), self.top1_matches / values.numel()
