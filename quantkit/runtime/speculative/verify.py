"""Verification of drafted tokens against the target's logits at every drafted position (one target pass).

For a sequence whose last token was run together with drafts ``d1..dk``, the target gives ``k + 1`` rows of
logits: row ``i`` is the distribution of the token after ``d_i`` (row 0: after the last real token).

* Greedy requests accept the longest prefix of drafts equal to the target's argmax, then add the target's own
  argmax at the first mismatch (or after the last draft): exactly the tokens decoding without speculation gives.
* Sampled requests use the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): draft ``d_i``
  drawn from ``q_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the
  token is drawn from ``normalize(max(p_i - q_i, 0))``; if all are accepted, one more from ``p_k``. The output
  then has the target's distribution whatever the drafts. n-gram drafts are deterministic: ``q_i`` is one-hot.
"""

from __future__ import annotations

import torch

from quantkit.runtime.sampler import processed_probs
from quantkit.runtime.sampling_params import SamplingParams


def verify_greedy(drafts: list[int], logits: torch.Tensor) -> list[int]:
    """Tokens to append: the accepted drafts, then the target's token. ``logits [k + 1, V]``."""
    target = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return [*drafts[:accepted], target[accepted]]


def verify_sampled(
    drafts: list[int],
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The speculative-sampling rule; ``draft_probs [k, V]`` (None: deterministic drafts, one-hot ``q``)."""
    probs = processed_probs(logits, [params] * logits.shape[0])  # [k + 1, V]
    device = probs.device
    out: list[int] = []
    for i, token in enumerate(drafts):
        p = probs[i]
        q_token = float(draft_probs[i, token]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator, device=device))
        if u * q_token < float(p[token]):  # u < p/q without dividing by a zero q
            out.append(token)
            continue
        if draft_probs is not None:
            residual = (p - draft_probs[i]).clamp_min(0)
        else:
            residual = p.clone()
            residual[token] = 0
        if float(residual.sum()) <= 0:  # p == q: every draft token would be accepted; cannot happen after u >= p/q
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
