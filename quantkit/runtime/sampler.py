"""Token sampling from fp32 logits: greedy, temperature, top-k, top-p, with per-request generators.

Each request may own a seeded ``torch.Generator`` (kept by the engine with the request, across preemption),
so a seeded request draws the same tokens whatever it is batched with. Requests without a seed share the
engine's generator.

A row that cannot be sampled (NaN logits, or no token left with any probability) fails its own request only:
:meth:`Sampler.sample` reports it instead of handing NaN to ``torch.multinomial`` (which raises on CPU and asserts on
the device on CUDA, failing the whole batch).
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.runtime.sampling_params import MIN_TEMPERATURE, SamplingParams


class SamplingError(QuantkitError):
    """Some rows could not be sampled (``failed``: row -> why)."""

    def __init__(self, failed: dict[int, str]) -> None:
        super().__init__(f"rows {sorted(failed)} could not be sampled: {next(iter(failed.values()))}")
        self.failed = failed


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) all but the ``top_k[b]`` largest logits of each row (ties at the threshold kept).

    ``top_k`` int64 ``[B]``; values < 1 or >= vocab leave the row unchanged.
    """
    vocab = logits.shape[-1]
    k = torch.where((top_k < 1) | (top_k > vocab), vocab, top_k)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p[b]`` (fp32 ``[B]``).

    A token is dropped when the mass of the tokens strictly more likely than it already reaches ``top_p``;
    the most likely token is always kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row is sampled from: fp32 softmax after temperature, top-k and top-p (``[B, V]``).

    Rows must be non-greedy (temperature >= MIN_TEMPERATURE); speculative sampling compares these for target and
    draft. A top_k above the vocabulary keeps every token (clamped before it becomes an int64 tensor).
    """
    sub = logits.float()
    device, vocab = sub.device, sub.shape[-1]
    sub = sub / torch.tensor([max(p.temperature, MIN_TEMPERATURE) for p in params], device=device)[:, None]
    if any(p.top_k > 0 for p in params):
        sub = apply_top_k(sub, torch.tensor([min(p.top_k, vocab) for p in params], device=device))
    if any(p.top_p < 1.0 for p in params):
        sub = apply_top_p(sub, torch.tensor([p.top_p for p in params], device=device))
    return sub.softmax(dim=-1)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for requests without their own seed

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """One token per row of ``logits [B, V]`` (fp32); raises :class:`SamplingError` if a row cannot be sampled."""
        tokens, failed = self.sample(logits, params, generators)
        if failed:
            raise SamplingError(failed)
        return tokens

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], dict[int, str]]:
        """One token per row (-1 for a row that failed) and the failed rows: row -> why."""
        out = logits.argmax(dim=-1).tolist()
        broken = (torch.isnan(logits).any(dim=-1) | torch.isneginf(logits).all(dim=-1)).tolist()
        failed = {i: "the logits are NaN or exclude every token" for i, bad in enumerate(broken) if bad}
        rows = [i for i, p in enumerate(params) if not p.greedy and i not in failed]
        if rows:
            probs = processed_probs(logits[rows], [params[i] for i in rows])
            usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
            for j, i in enumerate(rows):
                if not usable[j]:
                    failed[i] = "the sampling distribution is not finite"
                    continue
                out[i] = int(torch.multinomial(probs[j], 1, generator=self.generator_for(generators[i])))
        for i in failed:
            out[i] = -1
        return out, failed

    def generator_for(self, generator: torch.Generator | None) -> torch.Generator | None:
        return generator if generator is not None else self.generator
