"""Per-request sampling parameters (no tensors; the sampler on logits lives in the model runner)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NoReturn

from quantkit.errors import QuantkitError


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = -1  # -1: disabled
    seed: int | None = None  # per-request generator seed; None: the engine's global generator
    max_tokens: int = 16  # completion tokens to generate at most; 0 (with prompt_logprobs): score the prompt only
    stop: list[str] = field(default_factory=list)  # stop strings, matched by the engine after detokenizing
    stop_token_ids: list[int] = field(default_factory=list)  # finish on any of these (even with ignore_eos)
    ignore_eos: bool = False  # keep generating past the EOS token (benchmarks)
    # Log-probabilities (see quantkit.runtime.logprobs: the raw distribution, before temperature/top-k/top-p).
    # None: not computed (nothing is paid); k >= 0: each token's own log-probability and the k most likely tokens'.
    logprobs: int | None = None  # for each generated token
    prompt_logprobs: int | None = None  # for each prompt token but the first; such a request skips the prefix cache

    def __post_init__(self) -> None:
        # Own copies: a caller's list mutated later must not change a running request.
        # A bare string / id is taken as a one-element list.
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        ids = self.stop_token_ids
        self.stop_token_ids = [ids] if isinstance(ids, int) else list(ids)
        self.validate()

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or top_k 1 (only the best token survives)."""
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ``QuantkitError`` naming the field, the bad value and the valid range."""
        valid = "a finite number >= 0 (0 means greedy)"
        if not _is_number(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            _fail("temperature", self.temperature, valid)
        valid = "a number with 0 < top_p <= 1 (1 disables nucleus sampling)"
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, valid)
        valid = "-1 (disabled) or an integer >= 1"
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            _fail("top_k", self.top_k, valid)
        valid = "None or an integer in [0, 2**64)"
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            _fail("seed", self.seed, valid)
        if not _is_int(self.max_tokens) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            _fail("max_tokens", self.max_tokens, "an integer >= 1 (0, to only score the prompt, with prompt_logprobs)")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", self.stop, "a list of non-empty strings")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "True or False")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                _fail(name, value, "None or an integer >= 0 (how many of the most likely tokens to list)")


def _fail(name: str, value: object, valid: str) -> NoReturn:
    raise QuantkitError(f"sampling parameter {name}={value!r} is invalid; use {valid}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
