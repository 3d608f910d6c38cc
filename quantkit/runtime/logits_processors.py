"""Per-request changes to the logits before sampling: OpenAI's ``logit_bias`` and vLLM's ``min_tokens``.

``logit_bias`` adds each listed token's bias to its logit (greedy requests included: -100 all but bans a token, +100
all but forces it). ``min_tokens``: while a request has generated fewer tokens, its EOS (unless ``ignore_eos``) and
``stop_token_ids`` are masked to -inf, so it cannot stop on them (vLLM's ``all_stop_token_ids``). Log-probabilities
are scored from the logits before these changes, as vLLM's default ``raw_logprobs`` mode does.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from quantkit.runtime.sequence import Sequence


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> torch.Tensor:
    """``logits [B, V]`` (row ``i`` samples ``seqs[i]``'s next token) with the changes above; the same tensor when no
    request asks for any, else a new one (the input is left as it was)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    masked_rows: list[int] = []
    masked_cols: list[int] = []
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        for token, bias in params.logit_bias.items():
            if token < vocab:  # the engine refuses ids outside the vocabulary; a padded row has none to bias
                rows.append(row)
                cols.append(token)
                values.append(float(bias))
        if seq.num_completion_tokens < params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            stops = {t for t in stops if t < vocab}
            masked_rows += [row] * len(stops)
            masked_cols += sorted(stops)
    if not rows and not masked_rows:
        return logits
    out = logits.clone()
    device = out.device
    if rows:
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        out.index_put_(index, torch.tensor(values, device=device, dtype=out.dtype), accumulate=True)
    if masked_rows:
        out[torch.tensor(masked_rows, device=device), torch.tensor(masked_cols, device=device)] = float("-inf")
    return out
