"""The engine's token log-probabilities in OpenAI's legacy completions shape (``choices[i].logprobs``).

Token strings are each id decoded on its own (special tokens kept), as vLLM does; with no tokenizer they are
``token_id:<id>``. A non-finite log-probability (JSON has no -Infinity) is reported as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from quantkit.runtime.logprobs import TokenLogprob
from quantkit.server.protocol import CompletionLogprobs

FLOOR = -9999.0


class TokenStrings:
    """Per-id token strings, memoized (used from the tokenizer thread only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def lookup(self, ids: Iterable[int]) -> dict[int, str]:
        memo = self._memo
        missing = sorted({i for i in ids if i not in memo})
        if missing:
            if self.tokenizer is None:
                pieces = [f"token_id:{i}" for i in missing]
            else:
                pieces = self.tokenizer.batch_decode([[i] for i in missing], skip_special_tokens=False)
            memo.update(zip(missing, pieces, strict=True))
        return memo


def completion_logprobs(
    strings: TokenStrings, token_ids: list[int], scores: list[TokenLogprob | None], k: int, offset: int = 0
) -> tuple[CompletionLogprobs, int]:
    """The ``logprobs`` object for ``token_ids`` (``scores[i]`` scores token ``i``; None: unscored, the first prompt
    token) with up to ``k + 1`` entries in each ``top_logprobs``: the token itself, then the ``k`` most likely;
    ``offset``: the text offset of the first token. Also returns the offset after the last token."""
    if len(scores) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but {len(scores)} scores")
    wanted = list(token_ids)
    for score in scores:
        if score is not None:
            wanted += [i for i, _ in score.top[:k]]
    text = strings.lookup(wanted)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, score in zip(token_ids, scores, strict=True):
        piece = text[token_id]
        tokens.append(piece)
        text_offset.append(offset)
        offset += len(piece)
        if score is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(score.logprob))
        top = {piece: _finite(score.logprob)}
        for i, logprob in score.top[:k]:
            top.setdefault(text[i], _finite(logprob))  # two ids with the same string: the first (likelier) wins
        top_logprobs.append(top)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    ), offset


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
