"""Token sampling from fp32 logits: greedy, temperature, top-k, top-p, with per-request generators.

Each request may own a seeded ``torch.Generator`` (kept by the engine with the request, across preemption),
so a seeded request draws the same tokens whatever it is batched with. Requests without a seed share the
engine's generator.
"""

from __future__ import annotations

import torch

from quantkit.runtime.sampling_params import SamplingParams


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

    Rows must be non-greedy (temperature > 0); speculative sampling compares these for target and draft.
    """
    sub = logits.float()
    device = sub.device
    sub = sub / torch.tensor([p.temperature for p in params], device=device)[:, None]
    if any(p.top_k > 0 for p in params):
        sub = apply_top_k(sub, torch.tensor([p.top_k for p in params], device=device))
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
        """One token per row of ``logits [B, V]`` (fp32)."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens.tolist()
        probs = processed_probs(logits[rows], [params[i] for i in rows])
        out = tokens.tolist()
        for j, i in enumerate(rows):
            out[i] = int(torch.multinomial(probs[j], 1, generator=self.generator_for(generators[i])))
        return out

    def generator_for(self, generator: torch.Generator | None) -> torch.Generator | None:
        return generator if generator is not None else self.generator
