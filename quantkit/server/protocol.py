"""OpenAI-shaped request and response models, and the error object every failure is reported with."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantkit.errors import QuantkitError
from quantkit.runtime.sampling_params import SamplingParams


class APIError(Exception):
    """An HTTP error with an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        message = scrub_paths(self.message)
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response (documented in the OpenAPI schema)."""

    error: ErrorDetail


# An absolute POSIX path of two or more parts (but not a route such as /v1/completions): never shown to clients.
_PATH = re.compile(r"(?<![\w.:/])/(?!v1/)[\w.+@~-]+(?:/[\w.+@~-]*)+")


def scrub_paths(message: str) -> str:
    """``message`` with every local filesystem path replaced by ``<path>`` (error bodies reach any client)."""
    return _PATH.sub("<path>", message)


def path_redactor(paths: Iterable[str]) -> Callable[[str], str]:
    """:func:`scrub_paths` that also hides the given local paths, relative ones included (the model's directory as
    the server was started with it): engine messages name it. Names without a separator are left alone."""
    local = (p.rstrip("/\\") for p in paths if ("/" in p or "\\" in p) and os.path.exists(p))
    given = sorted({p for p in local if "/" in p or "\\" in p}, key=len)  # "/" itself is no name to hide
    pattern = re.compile("|".join(rf"(?<![\w.~/-]){re.escape(p)}(?![\w-])" for p in reversed(given))) if given else None

    def redact(message: str) -> str:
        return scrub_paths(pattern.sub("<path>", message) if pattern is not None else message)

    return redact


def check_unicode(data: Any) -> None:
    """APIError 400 for a string anywhere in a decoded JSON body that is not valid Unicode: a lone UTF-16
    surrogate such as ``"\\ud800"`` decodes to a str that no tokenizer or UTF-8 encoder accepts."""
    todo: list[tuple[str, Any]] = [("", data)]  # iterative: a deeply nested body cannot exhaust the stack
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(
                    400, f"{where or 'body'}: invalid Unicode (a lone UTF-16 surrogate at character {exc.start}); "
                    "send valid UTF-8 text", param=where.split(".", 1)[0] or None, code="invalid_unicode",
                ) from None  # fmt: skip
        elif isinstance(value, dict):
            todo += [(where, key) for key in value]
            todo += [(f"{where}.{key}" if where else str(key), item) for key, item in value.items()]
        elif isinstance(value, list):
            todo += [(f"{where}.{i}", item) for i, item in enumerate(value)]


MAX_LOGPROBS = 20  # most likely tokens a request may ask for at each position (vLLM's default limit)

# Strict scalars: JSON true is not an int or a float, "yes" is not a bool, "1" is not a number.
StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class BaseRequest(BaseModel):
    """Fields shared by both endpoints; unknown fields are accepted and ignored, as most OpenAI servers do."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, description="-1 (disabled) or an integer >= 1")] = -1
    seed: Annotated[StrictInt, Field(ge=0, lt=2**64)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[StrictInt, Field(ge=1, description="only 1 is supported")] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # extension (as in vLLM): generate max_tokens tokens
    # Accepted when they ask for nothing the runtime would have to do:
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, description="only 0 is supported")] = 0.0
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, description="only 0 is supported")] = 0.0
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; only n=1", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported; use 0", param=name)

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
                ignore_eos=self.ignore_eos,
                **self.logprob_options(),
            )
        except QuantkitError as exc:
            param = str(exc).removeprefix("sampling parameter ").split("=", 1)[0]
            raise APIError(400, str(exc), param=param) from None

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

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if self.suffix or self.best_of not in (None, 1):
            raise APIError(400, "suffix and best_of are not supported", param="suffix" if self.suffix else "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 returns nothing without echo; set echo: true to score the prompt",
                           param="max_tokens")  # fmt: skip
        return prompt

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
                raise APIError(400, "only text content parts are supported", param="messages")
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | StrictInt | None = Field(None, description="not supported here; use /v1/completions")

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise APIError(400, "logprobs are not supported on chat completions; use /v1/completions", param="logprobs")

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ----------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions ``logprobs``: one entry per token (the echoed prompt's, then the completion's).
    ``top_logprobs[i]`` maps the token and the ``logprobs`` most likely tokens to their log-probabilities; the first
    prompt token has none (null). ``text_offset[i]``: the summed length of the token strings before token ``i``
    (as vLLM computes it), from the start of the returned text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


def chunk(
    rid: str, created: int, model: str, choice: dict[str, Any] | None, usage: Usage | None = None, chat: bool = False
) -> dict[str, Any]:
    """One streamed event; ``choice`` is {"text": ...} or {"delta": {...}} plus finish_reason (None: usage only)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [] if choice is None else [{"index": 0, "logprobs": None, **choice}],
    }
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
