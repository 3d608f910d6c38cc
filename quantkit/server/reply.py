"""What one request's answer is made of besides the engine's outputs, and the pieces both the whole (JSON) and the
streamed (server-sent events) answers build from: usage, finish reason, log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.runtime.engine import RequestOutput
from quantkit.runtime.sequence import FinishReason
from quantkit.server.logprobs import completion_logprobs
from quantkit.server.protocol import CompletionLogprobs, Usage
from quantkit.server.tokenizing import PromptTokenizer


@dataclass(slots=True)
class Reply:
    chat: bool
    stops: list[str]
    include_usage: bool
    created: int  # unix seconds, stamped when the request arrived
    logprobs: int | None = None  # completions: return log-probabilities, with this many most likely tokens
    token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    tokenizer: PromptTokenizer | None = None  # decodes token strings for logprobs
    echo: str | None = None  # completions with echo: the prompt's text, returned before the completion


def usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def finish_reason(out: RequestOutput) -> str:
    return "length" if out.finish_reason is FinishReason.LENGTH else "stop"


async def logprobs_of(
    reply: Reply, out: RequestOutput, first: int, offset: int, with_prompt: bool
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
