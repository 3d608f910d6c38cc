"""``POST /v1/completions`` and ``POST /v1/chat/completions``: checked, tokenized off the event loop, queued on the
engine, answered whole (JSON) or streamed (server-sent events, :mod:`quantkit.server.sse`).

Order of work, cheapest first: the request's fields (schema, model, supported parameters, limits on stop strings,
logit_bias, ...); the prompt's size (characters, or token ids: count and range) before anything decodes or tokenizes
it; a slot on the server (429 when full) before tokenizing; then tokenizing, and the engine's own checks.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from quantkit.runtime.engine import RequestOutput
from quantkit.runtime.sequence import FinishReason
from quantkit.server.openapi import ERROR_RESPONSES
from quantkit.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatResponse,
    CompletionChoice,
    CompletionResponse,
    internal_error,
    new_id,
)
from quantkit.server.reply import Reply, finish_reason, logprobs_of, usage
from quantkit.server.requests import BaseRequest, ChatRequest, CompletionRequest
from quantkit.server.sse import stream
from quantkit.server.state import ServerState
from quantkit.server.tokenizing import chat_prompt_ids, decode, encode

CHARS_PER_TOKEN_LIMIT = 32  # a prompt longer than this many characters per context token is refused untokenized
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI

router = APIRouter()


@router.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
async def completions(req: CompletionRequest, request: Request) -> Any:
    state, created = _accept(req, request)
    prompt = req.single_prompt()
    params = req.sampling_params(req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_TOKENS)
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, str):
        _check_chars(len(prompt), state.max_model_len, "prompt")
    else:
        _check_token_ids(prompt, state)
    tenant, salt = _tenant_and_salt(request, req, state)
    rid = state.engine.reserve(tenant, req.priority)
    try:
        tokenizer = state.tokenizer
        if isinstance(prompt, str) and tokenizer.tokenizer is not None:  # without one the engine says so
            prompt = await tokenizer.run(encode, prompt)
        reply = Reply(False, params.stop, req.include_usage, created, req.logprobs, req.return_tokens_as_token_ids)
        reply.tokenizer = tokenizer
        if req.echo:
            reply.echo = text if text is not None else await tokenizer.run(decode, prompt)
        await state.engine.submit(rid, prompt, params, salt)
    except BaseException:
        state.engine.cleanup(rid, finished=True)
        raise
    return await _respond(state, req, rid, reply, request)


@router.post("/v1/chat/completions", responses={200: {"model": ChatResponse}, **ERROR_RESPONSES})
async def chat(req: ChatRequest, request: Request) -> Any:
    state, created = _accept(req, request)
    messages = req.plain_messages()
    limit = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    params = req.sampling_params(limit if limit is not None else state.max_model_len)
    _check_chars(sum(len(m["role"]) + len(m["content"]) for m in messages), state.max_model_len, "messages")
    tenant, salt = _tenant_and_salt(request, req, state)
    rid = state.engine.reserve(tenant, req.priority)
    try:
        ids = await state.tokenizer.run(chat_prompt_ids, messages)
        if limit is None:  # as OpenAI: up to the context length
            params.max_tokens = max(1, state.max_model_len - len(ids))
        await state.engine.submit(rid, ids, params, salt)
    except BaseException:
        state.engine.cleanup(rid, finished=True)
        raise
    return await _respond(state, req, rid, Reply(True, params.stop, req.include_usage, created), request)


def _accept(req: BaseRequest, request: Request) -> tuple[ServerState, int]:
    """The server's state and the request's arrival (unix seconds), once the request passes the checks."""
    state: ServerState = request.app.state.server
    created = int(time.time())
    _check(req, state)
    return state, created


def _check(req: BaseRequest, state: ServerState) -> None:
    if req.model != state.model_name:
        raise APIError(
            400, f"model {req.model!r} is not served here; use {state.model_name!r}", param="model",
            code="model_not_found",
        )  # fmt: skip
    for limit in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, limit, None)
        if value is not None and value > state.max_model_len:
            raise APIError(
                400, f"{limit}={value} is more than the {state.max_model_len}-token context; ask for at most "
                f"{state.max_model_len}", param=limit,
            )  # fmt: skip
    req.check_supported()


def _check_chars(chars: int, max_model_len: int, param: str) -> None:
    limit = CHARS_PER_TOKEN_LIMIT * max_model_len
    if chars > limit:
        raise APIError(
            400, f"the {param} has {chars} characters; at most {limit} are accepted ({CHARS_PER_TOKEN_LIMIT} per "
            f"token of the {max_model_len}-token context)", param=param, code="context_length_exceeded",
        )  # fmt: skip


def _check_token_ids(ids: list[int], state: ServerState) -> None:
    """A prompt of token ids: no longer than the context, every id in the vocabulary (before it is decoded)."""
    if len(ids) > state.max_model_len:
        raise APIError(
            400, f"the prompt has {len(ids)} token ids; the context holds {state.max_model_len}; send a shorter "
            "prompt", param="prompt", code="context_length_exceeded",
        )  # fmt: skip
    bad = [t for t in ids if t >= state.vocab_size]
    if bad:
        raise APIError(
            400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size}); send ids below "
            f"{state.vocab_size}", param="prompt",
        )  # fmt: skip


def _tenant_and_salt(request: Request, req: BaseRequest, state: ServerState) -> tuple[str, bytes | None]:
    """Who sent the request (its API key's tenant, set by the gate) and its prefix-cache salt: the key's (when the
    cache is salted per key) and the request's own ``cache_salt``."""
    tenant: str = getattr(request.state, "tenant", "")
    salt = state.cache_salts.get(tenant)
    if req.cache_salt is not None:
        salt = (salt or b"") + b"\x00" + req.cache_salt.encode()
    return tenant, salt


async def _respond(state: ServerState, req: BaseRequest, rid: str, reply: Reply, request: Request) -> Any:
    eng, model, chat = state.engine, state.model_name, reply.chat
    rid_out = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:  # the status waits for the first output: an error before it is a status, not an event
        try:
            first = await eng.wait_started(rid, request.is_disconnected)
        except BaseException:
            eng.cleanup(rid)
            raise
        if first is None:
            eng.cleanup(rid)
            return JSONResponse({}, 499)  # the client is gone; nobody reads this
        if first.finish_reason is FinishReason.ERROR:
            eng.cleanup(rid, finished=True)
            raise internal_error(rid)
        events = stream(eng, rid, rid_out, model, reply)
        background = BackgroundTask(eng.cleanup, rid)  # runs even when the client left before the first event
        return StreamingResponse(events, media_type="text/event-stream", background=background)
    final: RequestOutput | None = None
    async for out in eng.outputs(rid, request.is_disconnected):
        final = out
    if final is None or not final.finished:
        return JSONResponse({}, 499)  # the client is gone; nobody reads this
    if final.finish_reason is FinishReason.ERROR:
        raise internal_error(rid)
    reason = finish_reason(final)
    if chat:
        choice = ChatChoice(message=AssistantMessage(content=final.text), finish_reason=reason)
        return ChatResponse(id=rid_out, created=reply.created, model=model, choices=[choice], usage=usage(final))
    logprobs = None
    if reply.logprobs is not None:
        logprobs, _ = await logprobs_of(reply, final, 0, 0, with_prompt=reply.echo is not None)
    text = final.text if reply.echo is None else reply.echo + final.text
    choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=reason)
    return CompletionResponse(id=rid_out, created=reply.created, model=model, choices=[choice], usage=usage(final))
