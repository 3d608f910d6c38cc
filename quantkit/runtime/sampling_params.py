"""Per-request sampling parameters (no tensors; the sampler on logits lives in the model runner).

Limits that bound the work one request can ask of the engine thread (vLLM's, unless said otherwise):

* ``MIN_TEMPERATURE``: a temperature below it samples greedily. vLLM's ``_SAMPLING_EPS`` (1e-5); far below it the
  scaled logits overflow float32 (1e-300 is 0 in float32: a division by zero, then NaN into the sampler).
* ``MAX_STOP_STRINGS`` / ``MAX_STOP_CHARS``: every stop string is searched in the text on every token (on the engine
  thread, for the whole batch), so the count and the length drive per-step work for the life of the request.
  vLLM refuses more than ``VLLM_MAX_STOP_STRINGS`` (4, OpenAI's documented limit) and has no length limit; 16
  leaves room for evaluation harnesses that send more than four, and 256 characters holds any real stop marker.
* ``MAX_STOP_TOKEN_IDS`` (128) and ``MAX_LOGIT_BIAS`` (1024 entries): vLLM's limits for the same fields; a bias is
  in [-100, 100], as OpenAI defines it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NoReturn

from quantkit.errors import QuantkitError

MIN_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 128
MAX_LOGIT_BIAS = 1024
MAX_BIAS = 100.0


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE): greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = -1  # -1: disabled; more than the vocabulary keeps every token
    seed: int | None = None  # per-request generator seed; None: the engine's global generator
    max_tokens: int = 16  # completion tokens to generate at most; 0 (with prompt_logprobs): score the prompt only
    stop: list[str] = field(default_factory=list)  # stop strings, matched by the engine after detokenizing
    stop_token_ids: list[int] = field(default_factory=list)  # finish on any of these (even with ignore_eos)
    ignore_eos: bool = False  # keep generating past the EOS token (benchmarks)
    # Log-probabilities (see quantkit.runtime.logprobs: the raw distribution, before temperature/top-k/top-p).
    # None: not computed (nothing is paid); k >= 0: each token's own log-probability and the k most likely tokens'.
    logprobs: int | None = None  # for each generated token
    prompt_logprobs: int | None = None  # for each prompt token but the first; such a request skips the prefix cache
    # As vLLM: EOS and stop_token_ids cannot be generated, and stop strings are not searched, before this many tokens.
    min_tokens: int = 0
    # As OpenAI: token id -> a bias in [-100, 100] added to its logit before sampling (greedy included).
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Own copies: a caller's list mutated later must not change a running request.
        # A bare string / id is taken as a one-element list.
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        ids = self.stop_token_ids
        self.stop_token_ids = [ids] if isinstance(ids, int) else list(ids)
        self.logit_bias = dict(self.logit_bias)
        self.validate()

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature (near) 0, or top_k 1 (only the best token survives)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether logit_bias or min_tokens can change the logits this request samples from."""
        return bool(self.logit_bias) or self.min_tokens > 0

    def validate(self) -> None:
        """Raise ``QuantkitError`` naming the field, the bad value and the valid range."""
        valid = f"a finite number >= 0 (0, or below {MIN_TEMPERATURE:g}, means greedy)"
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
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"an integer from 0 to max_tokens ({self.max_tokens})")
        self._validate_stops()
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "True or False")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                _fail(name, value, "None or an integer >= 0 (how many of the most likely tokens to list)")
        self._validate_logit_bias()

    def _validate_stops(self) -> None:
        valid = f"a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters each"
        if len(self.stop) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop
        ):
            _fail("stop", self.stop, valid)
        valid = f"a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, valid)

    def _validate_logit_bias(self) -> None:
        valid = f"at most {MAX_LOGIT_BIAS} entries token id (an integer >= 0) -> bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}]"
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
            _is_int(token) and token >= 0 and _is_number(bias) and -MAX_BIAS <= bias <= MAX_BIAS
            for token, bias in self.logit_bias.items()
        ):
            _fail("logit_bias", self.logit_bias, valid)


def _fail(name: str, value: object, valid: str) -> NoReturn:
    shown = repr(value)
    if len(shown) > 100:  # a list of 10,000 stop strings is summarized, not echoed
        shown = f"<{type(value).__name__} of {len(value)} items>" if hasattr(value, "__len__") else shown[:100] + "..."
    raise QuantkitError(f"sampling parameter {name}={shown} is invalid; use {valid}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
