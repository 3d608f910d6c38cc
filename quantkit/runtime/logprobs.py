"""Token log-probabilities, as requests ask for them with ``SamplingParams.logprobs`` / ``prompt_logprobs``.

Every value is ``log_softmax`` of the model's fp32 logits: the raw distribution, before temperature, top-k and
top-p (what vLLM reports by default), so a greedy and a sampled request score the same text the same. Prompt
positions are scored from the prefill's logits (the logits at position ``p`` score token ``p + 1``; the first
prompt token has no score); generated tokens from the logits they were sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability and the ``k`` most likely tokens at its position, ``(id, logprob)`` best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprob]:
    """``logits [R, V]`` (any float dtype, computed in fp32), the token each row scores, and per row how many of the
    most likely tokens to list (0: none) -> one :class:`TokenLogprob` per row."""
    if len(targets) != logits.shape[0] or len(ks) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(targets)} targets and {len(ks)} top-k counts")
    if not targets:
        return []
    logp = logits.float().log_softmax(dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=logp.device)[:, None]
    chosen = logp.gather(-1, index)[:, 0].tolist()
    k = min(max(ks), logp.shape[-1])
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen, strict=True)]
    top = logp.topk(k, dim=-1)
    values, ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(t, lp, tuple(zip(i[:n], v[:n], strict=True)))
        for t, lp, i, v, n in zip(targets, chosen, ids, values, ks, strict=True)
    ]
