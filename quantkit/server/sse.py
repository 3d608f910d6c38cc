"""Streamed answers (``stream: true``): OpenAI's server-sent events, one JSON chunk per ``data:`` line, then
``data: [DONE]``. Text is sent as it becomes final: never half a character, and never the start of what may still
become a stop string."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quantkit.runtime.engine import RequestOutput
from quantkit.runtime.sequence import FinishReason
from quantkit.server.async_engine import AsyncEngine
from quantkit.server.protocol import APIError, chunk, internal_error
from quantkit.server.reply import Reply, finish_reason, logprobs_of, usage

DONE = "data: [DONE]\n\n"


async def stream(eng: AsyncEngine, rid: str, rid_out: str, model: str, reply: Reply) -> AsyncIterator[str]:
    chat, created = reply.chat, reply.created
    hold = max((len(s) for s in reply.stops), default=1) - 1  # a stop string's start may still be cut from the text
    sent = sent_tokens = offset = 0
    final: RequestOutput | None = None
    if chat:
        role = {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield event(chunk(rid_out, created, model, role, chat=True))
    try:
        async for out in eng.outputs(rid):
            if out.finish_reason is FinishReason.ERROR:
                final = out
                break
            if final is None and reply.echo is not None:  # the prompt first, as its own chunk (scored with logprobs)
                echo: dict[str, Any] = {"text": reply.echo, "finish_reason": None}
                if reply.logprobs is not None:
                    lp, offset = await logprobs_of(reply, out, len(out.token_ids), 0, with_prompt=True)
                    echo["logprobs"] = lp.model_dump()
                yield event(chunk(rid_out, created, model, echo))
            final = out
            text = out.text
            end = len(text) if out.finished else len(text.rstrip("\ufffd")) - hold  # no half characters
            delta = text[sent:end] if end > sent else ""
            sent = max(sent, end)
            reason = finish_reason(out) if out.finished else None
            scored = reply.logprobs is not None and len(out.token_ids) > sent_tokens
            if delta or reason or scored:
                content = {"delta": {"content": delta} if delta else {}} if chat else {"text": delta}
                body: dict[str, Any] = {**content, "finish_reason": reason}
                if scored:  # every new token with its score (the text may still hold some back)
                    lp, offset = await logprobs_of(reply, out, sent_tokens, offset, with_prompt=False)
                    body["logprobs"] = lp.model_dump()
                sent_tokens = len(out.token_ids)
                yield event(chunk(rid_out, created, model, body, chat=chat))
    except APIError as exc:
        yield event(exc.body())
        yield DONE
        return
    if final is not None and final.finish_reason is FinishReason.ERROR:
        yield event(internal_error(rid).body())
    elif final is not None and reply.include_usage:
        yield event(chunk(rid_out, created, model, None, usage(final), chat=chat))
    yield DONE


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
