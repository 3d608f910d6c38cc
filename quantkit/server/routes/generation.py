"""``POST /v1/completions`` and ``POST /v1/chat/completions``: checked, tokenized off the event loop, queued on the
engine, answered whole (JSON) or streamed (server-sent events, :mod:`quantkit.server.sse`)."""

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
    BaseRequest,
    ChatChoice,
    ChatRequest,
    ChatResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    new_id,
)
from quantkit.server.reply import Reply, finish_reason, logprobs_of, usage
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
    tokenizer = state.tokenizer
    if isinstance(prompt, str) and tokenizer.tokenizer is not None:  # without one the engine says so
        _check_chars(len(prompt), state.max_model_len, "prompt")
        prompt = await tokenizer.run(encode, prompt)
    reply = Reply(False, params.stop, req.include_usage, created, req.logprobs, req.return_tokens_as_token_ids)
    reply.tokenizer = tokenizer
    if req.echo:
        reply.echo = text if text is not None else await tokenizer.run(decode, prompt)
    rid = await state.engine.add(lambda _: (prompt, params))
    return await _respond(state, req, rid, reply, request)


@router.post("/v1/chat/completions", responses={200: {"model": ChatResponse}, **ERROR_RESPONSES})
async def chat(req: ChatRequest, request: Request) -> Any:
    state, created = _accept(req, request)
    messages = req.plain_messages()
    limit = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    params = req.sampling_params(limit if limit is not None else 1)
    _check_chars(sum(len(m["role"]) + len(m["content"]) for m in messages), state.max_model_len, "messages")
    ids = await state.tokenizer.run(chat_prompt_ids, messages)
    if limit is None:  # as OpenAI: up to the context length
        params.max_tokens = max(1, state.max_model_len - len(ids))
    rid = await state.engine.add(lambda _: (ids, params))
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
            raise APIError(400, f"{limit}={value} is more than the {state.max_model_len}-token context", param=limit)
    req.check_supported()


def _check_chars(chars: int, max_model_len: int, param: str) -> None:
    limit = CHARS_PER_TOKEN_LIMIT * max_model_len
    if chars > limit:
        raise APIError(
            400, f"the {param} has {chars} characters; at most {limit} are accepted ({CHARS_PER_TOKEN_LIMIT} per "
            f"token of the {max_model_len}-token context)", param=param, code="context_length_exceeded",
        )  # fmt: skip


async def _respond(state: ServerState, req: BaseRequest, rid: str, reply: Reply, request: Request) -> Any:
    eng, model, chat = state.engine, state.model_name, reply.chat
    rid_out = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        events = stream(eng, rid, rid_out, model, reply)
        background = BackgroundTask(eng.cleanup, rid)  # runs even when the client left before the first event
        return StreamingResponse(events, media_type="text/event-stream", background=background)
    final: RequestOutput | None = None
    async for out in eng.outputs(rid, request.is_disconnected):
        final = out
    if final is None or not final.finished:
        return JSONResponse({}, 499)  # the client is gone; nobody reads this
    if final.finish_reason is FinishReason.ERROR:
        raise APIError(500, final.error or "generation failed", "server_error")
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
