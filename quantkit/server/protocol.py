"""OpenAI-shaped response models, and the error object every failure is reported with (the request models are in
:mod:`quantkit.server.requests`)."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field


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


MAX_LOGPROBS = 20  # most likely tokens a request may ask for at each position (vLLM's default limit)


def invalid_unicode(where: str, at: int | None = None) -> APIError:
    """A string holding a lone UTF-16 surrogate (``"\\ud800"``): no tokenizer or UTF-8 encoder accepts it."""
    position = f" at character {at}" if at is not None else ""
    return APIError(
        400, f"{where}: invalid Unicode (a lone UTF-16 surrogate{position}); send valid UTF-8 text",
        param=where.split(".", 1)[0] or None, code="invalid_unicode",
    )  # fmt: skip


def internal_error(request_id: str, status: int = 500) -> APIError:
    """What a client sees when the server failed on its request: no exception text (it may name devices, memory or
    paths), the request id to find the details in the server log."""
    return APIError(
        status, f"the server failed on this request (request id {request_id}); the server log has the details. Retry; "
        "report the request id if it keeps failing", "server_error", code="internal_error",
    )  # fmt: skip


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
