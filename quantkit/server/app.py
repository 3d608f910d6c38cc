"""The OpenAI-compatible HTTP app: ``create_app(engine_or_model, ServeConfig)``."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quantkit.errors import QuantkitError
from quantkit.model.gguf_import import ALIASES
from quantkit.runtime.engine import Engine, RequestOutput
from quantkit.runtime.sequence import FinishReason
from quantkit.server.async_engine import AsyncEngine, bad_request
from quantkit.server.config import ServeConfig
from quantkit.server.logprobs import TokenStrings, completion_logprobs
from quantkit.server.metrics import Metrics, resident_memory_bytes
from quantkit.server.protocol import (
    APIError,
    AssistantMessage,
    BaseRequest,
    ChatChoice,
    ChatRequest,
    ChatResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Usage,
    chunk,
    new_id,
    path_redactor,
)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CHARS_PER_TOKEN_LIMIT = 32  # a prompt longer than this many characters per context token is refused untokenized

_ERROR = {"model": ErrorResponse}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "Bad request: malformed JSON, a wrong type, a value out of range, invalid "
          "Unicode, an unknown model, or a prompt that does not fit the context."},
    401: {**_ERROR, "description": "Missing or wrong API key."},
    408: {**_ERROR, "description": "The request body did not arrive within the server's --body-timeout."},
    413: {**_ERROR, "description": "The request body is larger than the server's --max-body-bytes."},
    429: {**_ERROR, "description": "The server queue is full; retry later."},
    503: {**_ERROR, "description": "The server is shutting down."},
}  # fmt: skip


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    metrics: Metrics
    model_name: str
    api_key: str | None
    max_body_bytes: int = ServeConfig.max_body_bytes
    body_timeout: float = ServeConfig.body_timeout
    draining: bool = False  # set on SIGTERM: new requests get 503 while running ones finish


def create_app(engine_or_model: Engine | str | Path, config: ServeConfig | None = None) -> FastAPI:
    """``engine_or_model``: an :class:`Engine`, or anything ``quantkit.LLM`` accepts (loaded now)."""
    config = config or ServeConfig()
    if isinstance(engine_or_model, Engine):
        engine, default_name = engine_or_model, default_served_name(engine_or_model.path)
    else:
        engine, default_name = Engine(engine_or_model, config.engine_config()), default_served_name(engine_or_model)
    metrics = Metrics()
    name = config.served_model_name or default_name
    local = [engine.path, engine_or_model if not isinstance(engine_or_model, Engine) else None, config.draft_model]
    redact = path_redactor(str(p) for p in local if p is not None)
    state = ServerState(
        AsyncEngine(engine, config.max_queue, metrics, redact),
        metrics,
        name,
        config.api_key,
        config.max_body_bytes,
        config.body_timeout,
    )
    started = int(time.time())
    tokenizer = _Tokenizer(engine.tokenizer)
    max_chars = CHARS_PER_TOKEN_LIMIT * engine.max_model_len

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        state.engine.stop()

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = _openapi_document(app.openapi, name, engine.max_model_len)  # type: ignore[method-assign]
    app.state.server = state
    app.add_middleware(_Gate, state=state)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": started, "owned_by": "quantkit"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.max_model_len}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        stats = state.engine.stats
        sampled = {  # vLLM's names where the meaning is vLLM's (see quantkit.server.metrics)
            "vllm:num_requests_running": ("gauge", "Sequences in the running batch.", lambda: stats.running),
            "vllm:num_requests_waiting": ("gauge", "Sequences waiting for admission.", lambda: stats.waiting),
            "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage; 1 means 100 percent.", lambda: stats.kv_usage),
            "vllm:num_preemptions_total": (
                "counter", "Sequences preempted (sent back to waiting, recomputed later).", lambda: stats.preemptions
            ),
            "quantkit_num_requests_in_flight": (
                "gauge", "HTTP requests being served.", lambda: state.engine.num_in_flight
            ),
            "quantkit_kv_cache_free_blocks": ("gauge", "Free KV blocks.", lambda: stats.free_blocks),
            "quantkit_spec_decode_acceptance_rate": (
                "gauge", "Draft tokens accepted / drafted (speculative decoding).", lambda: stats.spec_acceptance
            ),
            "quantkit_spec_decode_tokens_per_step": (
                "gauge", "Tokens per target pass of a sequence with drafts.", lambda: stats.spec_tokens_per_step
            ),
            "process_resident_memory_bytes": ("gauge", "Resident memory of the server process.", resident_memory_bytes),
        }  # fmt: skip
        text = state.metrics.render(state.model_name, sampled)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
    async def completions(req: CompletionRequest, request: Request) -> Any:
        created = int(time.time())
        _check(req, state, engine.max_model_len)
        prompt = req.single_prompt()
        params = req.sampling_params(req.max_tokens if req.max_tokens is not None else 16)
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str) and tokenizer.tokenizer is not None:  # without one the engine says so
            _check_chars(len(prompt), max_chars, "prompt")
            prompt = await tokenizer.run(_encode, prompt)
        reply = _Reply(False, params.stop, req.include_usage, created, req.logprobs, req.return_tokens_as_token_ids)
        reply.tokenizer = tokenizer
        if req.echo:
            reply.echo = text if text is not None else await tokenizer.run(_decode, prompt)
        rid = await state.engine.add(lambda _: (prompt, params))
        return await _respond(state, req, rid, reply, request)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatResponse}, **ERROR_RESPONSES})
    async def chat(req: ChatRequest, request: Request) -> Any:
        created = int(time.time())
        _check(req, state, engine.max_model_len)
        messages = req.plain_messages()
        limit = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        params = req.sampling_params(limit if limit is not None else 1)
        _check_chars(sum(len(m["role"]) + len(m["content"]) for m in messages), max_chars, "messages")
        ids = await tokenizer.run(chat_prompt_ids, messages)
        if limit is None:  # as OpenAI: up to the context length
            params.max_tokens = max(1, engine.max_model_len - len(ids))
        rid = await state.engine.add(lambda _: (ids, params))
        return await _respond(state, req, rid, _Reply(True, params.stop, req.include_usage, created), request)

    return app


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The tokenizer's chat template (with the assistant prompt); without one, plain ``role: content`` lines."""
    if tokenizer is None:
        raise QuantkitError("this model has no tokenizer, so chat requests are not possible; use /v1/completions")
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # template errors (e.g. roles out of order) are the request's fault
            raise APIError(400, f"chat template failed: {exc}", param="messages") from None
        return list(tokenizer(text, add_special_tokens=False).input_ids)  # the template has the special tokens
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer(text).input_ids)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)  # as Engine.encode


def _decode(tokenizer: Any, ids: list[int]) -> str:
    """The echoed text of a prompt sent as token ids: decoded with its special tokens, as vLLM does (nothing
    without a tokenizer)."""
    return "" if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=False))


class _Tokenizer:
    """Prompts are tokenized on a thread of their own with their own copy of the tokenizer: never on the event
    loop, and never on the engine thread, where a huge prompt would stall every running request."""

    def __init__(self, tokenizer: Any) -> None:
        try:
            self.tokenizer = copy.deepcopy(tokenizer)  # not shared with the engine thread's detokenizer
        except Exception:  # a tokenizer that cannot be copied: calls that only read it are thread-safe
            self.tokenizer = tokenizer
        self.strings = TokenStrings(self.tokenizer)  # token strings for logprobs, memoized on this thread
        self.id_strings = TokenStrings(None)  # "token_id:<id>" (return_tokens_as_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quantkit-tokenize")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(tokenizer, *args)`` on the tokenizer thread; a QuantkitError (no tokenizer) becomes a 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.tokenizer, *args)
        except QuantkitError as exc:
            raise bad_request(str(exc)) from None

    async def run_strings(self, as_ids: bool, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(token_strings, *args)`` on the tokenizer thread (``as_ids``: strings ``token_id:<id>``)."""
        strings = self.id_strings if as_ids else self.strings
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, strings, *args)


def _check_chars(chars: int, limit: int, param: str) -> None:
    if chars > limit:
        raise APIError(
            400, f"the {param} has {chars} characters; at most {limit} are accepted ({CHARS_PER_TOKEN_LIMIT} per "
            f"token of the {limit // CHARS_PER_TOKEN_LIMIT}-token context)", param=param,
            code="context_length_exceeded",
        )  # fmt: skip


def default_served_name(model: str | Path) -> str:
    """The name clients send when ``--served-model-name`` is not given, never a local path: an alias as given (its
    cached directory has the alias's name); a local directory's own name (a Hugging Face cache snapshot: the hub
    id it holds); a hub id as given."""
    text = str(model)
    if text in ALIASES:
        return text
    path = Path(text).expanduser()
    if not path.exists():
        return text  # a hub id: resolving it downloads it into the cache
    path = path.resolve()
    repo = path.parent.parent.name  # <cache>/models--org--name/snapshots/<commit>
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name or "model"


# One server-sent event: `data:` holds a JSON chunk, or [DONE] last.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def _openapi_document(
    openapi: Callable[[], dict[str, Any]], model_name: str, max_model_len: int
) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema with what this server really does: request errors are 400 with an error object
    (documented per route), never FastAPI's 422; `model` must be the served name; no request may ask for more
    tokens than the context holds; a 200 is JSON, or server-sent events with `stream: true`."""

    def schema() -> dict[str, Any]:
        doc = openapi()
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for name in ("CompletionRequest", "ChatRequest"):
            properties = components.get(name, {}).get("properties", {})
            if "model" in properties:
                properties["model"]["enum"] = [model_name]
            for limit in ("max_tokens", "max_completion_tokens"):
                for option in properties.get(limit, {}).get("anyOf", []):
                    if option.get("type") == "integer":
                        option["maximum"] = max_model_len
        for route in ("/v1/completions", "/v1/chat/completions"):
            ok = doc.get("paths", {}).get(route, {}).get("post", {}).get("responses", {}).get("200", {})
            ok.setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
        return doc

    return schema


def _check(req: BaseRequest, state: ServerState, max_model_len: int) -> None:
    if req.model != state.model_name:
        raise APIError(
            400, f"model {req.model!r} is not served here; use {state.model_name!r}", param="model",
            code="model_not_found",
        )  # fmt: skip
    for limit in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, limit, None)
        if value is not None and value > max_model_len:
            raise APIError(400, f"{limit}={value} is more than the {max_model_len}-token context", param=limit)
    req.check_supported()


@dataclass(slots=True)
class _Reply:
    """What one request's answer needs besides the engine's outputs."""

    chat: bool
    stops: list[str]
    include_usage: bool
    created: int  # unix seconds, stamped when the request arrived
    logprobs: int | None = None  # completions: return log-probabilities, with this many most likely tokens
    token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    tokenizer: _Tokenizer | None = None  # decodes token strings for logprobs
    echo: str | None = None  # completions with echo: the prompt's text, returned before the completion


async def _respond(state: ServerState, req: BaseRequest, rid: str, reply: _Reply, request: Request) -> Any:
    eng, model, chat = state.engine, state.model_name, reply.chat
    rid_out = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        events = _stream(eng, rid, rid_out, model, reply)
        background = BackgroundTask(eng.cleanup, rid)  # runs even when the client left before the first event
        return StreamingResponse(events, media_type="text/event-stream", background=background)
    final: RequestOutput | None = None
    async for out in eng.outputs(rid, request.is_disconnected):
        final = out
    if final is None or not final.finished:
        return JSONResponse({}, 499)  # the client is gone; nobody reads this
    if final.finish_reason is FinishReason.ERROR:
        raise APIError(500, final.error or "generation failed", "server_error")
    usage = _usage(final)
    reason = _reason(final)
    if chat:
        choice = ChatChoice(message=AssistantMessage(content=final.text), finish_reason=reason)
        return ChatResponse(id=rid_out, created=reply.created, model=model, choices=[choice], usage=usage)
    logprobs = None
    if reply.logprobs is not None:
        logprobs, _ = await _logprobs(reply, final, 0, 0, with_prompt=reply.echo is not None)
    text = final.text if reply.echo is None else reply.echo + final.text
    choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=reason)
    return CompletionResponse(id=rid_out, created=reply.created, model=model, choices=[choice], usage=usage)


async def _logprobs(
    reply: _Reply, out: RequestOutput, first: int, offset: int, with_prompt: bool
) -> tuple[CompletionLogprobs, int]:
    """The ``logprobs`` of ``out``'s completion tokens from index ``first`` on, after the prompt's ``with_prompt``,
    their text offsets starting at ``offset``; and the offset after them."""
    assert reply.tokenizer is not None and reply.logprobs is not None
    ids, scores = list(out.token_ids[first:]), list((out.logprobs or [])[first:])
    if with_prompt:
        prompt = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        ids, scores = [*out.prompt_token_ids, *ids], [*prompt, *scores]
    tokenizer, k = reply.tokenizer, reply.logprobs
    return await tokenizer.run_strings(reply.token_ids, completion_logprobs, ids, scores, k, offset)


async def _stream(eng: AsyncEngine, rid: str, rid_out: str, model: str, reply: _Reply) -> AsyncIterator[str]:
    chat, created = reply.chat, reply.created
    hold = max((len(s) for s in reply.stops), default=1) - 1  # a stop string's start may still be cut from the text
    sent = sent_tokens = offset = 0
    final: RequestOutput | None = None
    if chat:
        role = {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield _event(chunk(rid_out, created, model, role, chat=True))
    try:
        async for out in eng.outputs(rid):
            if out.finish_reason is FinishReason.ERROR:
                final = out
                break
            if final is None and reply.echo is not None:  # the prompt first, as its own chunk (scored with logprobs)
                echo: dict[str, Any] = {"text": reply.echo, "finish_reason": None}
                if reply.logprobs is not None:
                    lp, offset = await _logprobs(reply, out, len(out.token_ids), 0, with_prompt=True)
                    echo["logprobs"] = lp.model_dump()
                yield _event(chunk(rid_out, created, model, echo))
            final = out
            text = out.text
            end = len(text) if out.finished else len(text.rstrip("\ufffd")) - hold  # no half characters
            delta = text[sent:end] if end > sent else ""
            sent = max(sent, end)
            reason = _reason(out) if out.finished else None
            scored = reply.logprobs is not None and len(out.token_ids) > sent_tokens
            if delta or reason or scored:
                content = {"delta": {"content": delta} if delta else {}} if chat else {"text": delta}
                body: dict[str, Any] = {**content, "finish_reason": reason}
                if scored:  # every new token with its score (the text may still hold some back)
                    lp, offset = await _logprobs(reply, out, sent_tokens, offset, with_prompt=False)
                    body["logprobs"] = lp.model_dump()
                sent_tokens = len(out.token_ids)
                yield _event(chunk(rid_out, created, model, body, chat=chat))
    except APIError as exc:
        yield _event(exc.body())
        yield "data: [DONE]\n\n"
        return
    if final is not None and final.finish_reason is FinishReason.ERROR:
        yield _event(APIError(500, final.error or "generation failed", "server_error").body())
    elif final is not None and reply.include_usage:
        yield _event(chunk(rid_out, created, model, None, _usage(final), chat=chat))
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _reason(out: RequestOutput) -> str:
    return "length" if out.finish_reason is FinishReason.LENGTH else "stop"


# ----------------------------------------------------------------- errors and the gate
async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), exc.status)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
    if first.get("type") == "json_invalid":
        return JSONResponse(APIError(400, f"malformed JSON body: {first.get('msg', '')}").body(), 400)
    param = ".".join(loc) or None
    return JSONResponse(APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param).body(), 400)


def _union_tag(part: str | int) -> bool:
    """Pydantic's name for the member of a union that failed ("constrained-str", "list[int]"): not a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in {"str", "int", "float", "bool", "list"})


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = APIError(exc.status_code, str(exc.detail), kind).body()
    return JSONResponse(body, exc.status_code, headers=exc.headers)  # a 405 keeps its Allow header


class _Gate:
    """Outermost app middleware: 503 while draining, 401 without the API key, and requests counted by status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        status = 500  # an exception escaping the app becomes a 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self._refuse(scope, path)
            if error is None and scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await _read_body(scope, receive, self.state.max_body_bytes, self.state.body_timeout)
                if isinstance(body, APIError):
                    error = body
                else:
                    receive = _replay(body, receive)
            if error is None:
                await self.app(scope, receive, counted)
            else:
                headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
                await JSONResponse(error.body(), error.status, headers)(scope, receive, counted)
        finally:
            self.state.metrics.count_request(path if path in ROUTES else "other", status)

    def _refuse(self, scope: Scope, path: str) -> APIError | None:
        key = self.state.api_key
        if key is not None and path != "/health":
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            # the scheme is case-insensitive (RFC 9110); the key is compared as the UTF-8 bytes sent
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())):
                return APIError(401, "invalid or missing API key", code="invalid_api_key")
        if self.state.draining and path.startswith("/v1/"):
            return APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        return None


async def _read_body(scope: Scope, receive: Receive, limit: int, timeout: float) -> bytes | APIError:
    """The whole request body, or a 413 error as soon as it is known to exceed ``limit`` bytes: from its
    Content-Length before anything is read, else once the bytes read pass it (nothing is parsed before); a 408
    error when the whole body has not arrived within ``timeout`` seconds (a slow client holds no connection)."""
    too_big = APIError(
        413, f"the request body is larger than {limit} bytes (the server's --max-body-bytes)",
        param=None, code="request_too_large",
    )  # fmt: skip
    length = dict(scope["headers"]).get(b"content-length", b"")
    if length.strip().isdigit() and int(length) > limit:
        return too_big
    chunks: list[bytes] = []
    size = 0
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            return APIError(
                408, f"the request body did not arrive within {timeout:g} s (the server's --body-timeout)",
                param=None, code="request_timeout",
            )  # fmt: skip
        if message["type"] != "http.request":  # the client left: the app sees an empty body and its disconnect
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return too_big
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the connection's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
