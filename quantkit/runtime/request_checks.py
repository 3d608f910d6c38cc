"""Checks of what a request names by token id (prompt, stop_token_ids, logit_bias) against the model's vocabulary,
done before the request reaches the scheduler: an id the embedding or the logits do not have is the caller's error,
never a failed step."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from quantkit.errors import QuantkitError
from quantkit.runtime.sampling_params import SamplingParams


def prompt_token_ids(prompt: Sequence[object], vocab_size: int) -> list[int]:
    """``prompt`` as a list of ints, each in ``[0, vocab_size)``; any integer-like ids (numpy, 0-d tensors) are taken,
    bools and floats are refused."""
    try:
        ids = [operator.index(t) for t in prompt if not isinstance(t, bool)]  # type: ignore[call-overload]
        if len(ids) != len(prompt):
            raise TypeError
    except TypeError:
        raise QuantkitError("a prompt must be a string or a list of integer token ids") from None
    _in_vocabulary("prompt token ids", ids, vocab_size)
    return ids


def check_sampling_ids(params: SamplingParams, vocab_size: int) -> None:
    """stop_token_ids and logit_bias keys must be token ids of the model."""
    _in_vocabulary("stop_token_ids", params.stop_token_ids, vocab_size)
    _in_vocabulary("logit_bias token ids", params.logit_bias, vocab_size)


def _in_vocabulary(what: str, ids: Iterable[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise QuantkitError(
            f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size}); use ids below {vocab_size}"
        )
