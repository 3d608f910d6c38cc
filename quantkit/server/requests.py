"""OpenAI-shaped request models, with the limits that bound one request's work (documented in the OpenAPI schema).

Only the strings the server uses are checked for valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``
decodes to a str no tokenizer or UTF-8 encoder accepts); ignored extra fields are never walked, whatever their size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantkit.errors import QuantkitError
from quantkit.runtime.sampling_params import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_TEMPERATURE,
    SamplingParams,
)
from quantkit.server.protocol import MAX_LOGPROBS, APIError, invalid_unicode
from quantkit.server.unsupported import check_supported

MAX_CACHE_SALT_CHARS = 256

# Strict scalars: JSON true is not an int or a float, "yes" is not a bool, "1" is not a number.
StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**32)]  # beyond the vocabulary: 400 from the route
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Bias = Annotated[StrictFloat, Field(ge=-MAX_BIAS, le=MAX_BIAS)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class BaseRequest(BaseModel):
    """Fields shared by both endpoints; unknown fields are accepted and ignored, as most OpenAI servers do, unless
    they ask for something not implemented (:mod:`quantkit.server.unsupported`)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[
        StrictFloat, Field(ge=0, description=f"0, or anything below {MIN_TEMPERATURE:g}, samples greedily")
    ] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[
        StrictInt, Field(ge=-1, description="-1 (disabled) or an integer >= 1; above the vocabulary keeps every token")
    ] = -1
    seed: Annotated[StrictInt, Field(ge=0, lt=2**64)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings of up to {MAX_STOP_CHARS} characters"
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="extension (as in vLLM): finish on any of these token ids"
    )
    min_tokens: Annotated[StrictInt, Field(ge=0)] = Field(
        0, description="extension (as in vLLM): no EOS, stop token or stop string before this many tokens"
    )
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description=f"token id -> bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}] added to its logit (up to "
        f"{MAX_LOGIT_BIAS} entries)",
    )  # fmt: skip
    priority: Annotated[StrictInt, Field(ge=-(2**31), lt=2**31)] = Field(
        0, description="extension (as in vLLM): lower is served first among this API key's waiting requests"
    )
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = Field(
        None, description="extension (as in vLLM): only requests with the same salt share prefix-cache blocks"
    )
    n: Annotated[StrictInt, Field(ge=1, description="only 1 is supported")] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # extension (as in vLLM): generate max_tokens tokens
    # Accepted when they ask for nothing the runtime would have to do:
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, description="only 0 is supported")] = 0.0
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, description="only 0 is supported")] = 0.0
    user: str | None = None

    @model_validator(mode="after")
    def _valid_unicode(self) -> BaseRequest:
        for param, text in self.strings():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise invalid_unicode(param, exc.start) from None
        return self

    def strings(self) -> Iterator[tuple[str, str]]:
        """(where, text) of every string the server uses."""
        yield "model", self.model
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        yield from ((f"stop.{i}", s) for i, s in enumerate(stops))
        if self.cache_salt is not None:
            yield "cache_salt", self.cache_salt

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; only n=1", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported; use 0", param=name)
        check_supported({**(self.model_extra or {}), **self._declared_unsupported()}, isinstance(self, ChatRequest))

    def _declared_unsupported(self) -> dict[str, Any]:
        return {}

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises APIError naming the parameter for an out-of-range value."""
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                max_tokens=max_tokens,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logit_bias=self._logit_bias(),
                **self.logprob_options(),
            )
        except QuantkitError as exc:
            param = str(exc).removeprefix("sampling parameter ").split("=", 1)[0]
            raise APIError(400, str(exc), param=param) from None

    def _logit_bias(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise APIError(
                    400, f"logit_bias key {key[:20]!r} is not a token id; use token ids as decimal strings, e.g. "
                    '{"50256": -100}', param="logit_bias",
                )  # fmt: skip
            bias[int(key)] = value
        return bias

    def logprob_options(self) -> dict[str, int | None]:
        """``logprobs`` / ``prompt_logprobs`` for :class:`SamplingParams` (none by default)."""
        return {}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(BaseRequest):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    ) = Field(description="one prompt: text or token ids (a list holding one prompt is accepted)")
    max_tokens: Annotated[StrictInt, Field(ge=0, description="0 (with echo): return the prompt, scored")] | None = None
    logprobs: (
        Annotated[
            StrictInt,
            Field(
                ge=0, le=MAX_LOGPROBS,
                description="Return log-probabilities of the tokens, and of this many most likely tokens at each "
                f"position (0..{MAX_LOGPROBS}). Values are the model's raw distribution (log-softmax of its logits, "
                "before temperature, top_k and top_p), as vLLM reports by default.",
            ),
        ]
        | None
    ) = None  # fmt: skip
    echo: StrictBool = Field(
        False, description="Return the prompt before the completion (with logprobs: the prompt's tokens scored too)"
    )
    return_tokens_as_token_ids: StrictBool = Field(
        False, description='extension (as in vLLM): name tokens in logprobs "token_id:<id>", not by their text'
    )
    best_of: StrictInt | None = None
    suffix: str | None = None

    def strings(self) -> Iterator[tuple[str, str]]:
        yield from super().strings()
        if isinstance(self.prompt, str):
            yield "prompt", self.prompt
        elif self.prompt and isinstance(self.prompt[0], str):
            yield from ((f"prompt.{i}", p) for i, p in enumerate(self.prompt) if isinstance(p, str))

    def _declared_unsupported(self) -> dict[str, Any]:
        return {"best_of": self.best_of}

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400, "only one prompt per request is supported; send one request per prompt", param="prompt"
                )
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty; send at least one character or token id", param="prompt")
        if self.suffix:
            raise APIError(400, "suffix is not supported; put the text into the prompt", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 returns nothing without echo; set echo: true to score the prompt",
                           param="max_tokens")  # fmt: skip
        return prompt  # type: ignore[return-value]

    def logprob_options(self) -> dict[str, int | None]:
        # max_tokens 0 runs a prefill only, which the engine does for a request that scores its prompt
        prompt = self.logprobs if self.logprobs is not None else 0 if self.max_tokens == 0 else None
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt if self.echo else None}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise APIError(
                    400, 'only text content parts are supported; send {"type": "text"} parts', param="messages"
                )
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | StrictInt | None = Field(None, description="not supported here; use /v1/completions")

    def strings(self) -> Iterator[tuple[str, str]]:
        yield from super().strings()
        for i, message in enumerate(self.messages):
            if isinstance(message.content, str):
                yield f"messages.{i}.content", message.content
            elif message.content is not None:
                yield from ((f"messages.{i}.content.{j}", p.text) for j, p in enumerate(message.content))

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise APIError(400, "logprobs are not supported on chat completions; use /v1/completions", param="logprobs")

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
