"""Request parameters that would change what is generated but that this server does not implement: a request that
sets one to anything but a value asking for nothing gets 400 naming it (accepting and ignoring it would answer a
different question than the one asked). Parameters that change nothing generated (``user``, ``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls`` without tools) stay accepted and ignored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantkit.server.protocol import APIError


@dataclass(frozen=True, slots=True)
class Unsupported:
    fix: str  # what to do instead
    neutral: tuple[Any, ...] = (None,)  # values that ask for nothing: accepted
    chat_only: bool = False  # implemented on /v1/completions


_STRUCTURED = "structured output is not implemented; describe the format in the prompt and leave {name} out"
_TOOLS = "tool calling is not implemented; describe the tools in the prompt and leave {name} out"
_SAMPLER = "{name} is not implemented by this server's sampler; leave it out"
_TEMPLATE = "the server applies the model's own chat template as is; leave {name} out"

UNSUPPORTED: dict[str, Unsupported] = {
    "response_format": Unsupported(_STRUCTURED, (None, {"type": "text"})),
    "structured_outputs": Unsupported(_STRUCTURED),
    "guided_json": Unsupported(_STRUCTURED),
    "guided_regex": Unsupported(_STRUCTURED),
    "guided_choice": Unsupported(_STRUCTURED),
    "guided_grammar": Unsupported(_STRUCTURED),
    "tools": Unsupported(_TOOLS, (None, [])),
    "tool_choice": Unsupported(_TOOLS, (None, "none", "auto")),
    "functions": Unsupported(_TOOLS, (None, [])),
    "function_call": Unsupported(_TOOLS, (None, "none", "auto")),
    "repetition_penalty": Unsupported(_SAMPLER + " (or send 1.0)", (None, 1, 1.0)),
    "min_p": Unsupported(_SAMPLER + " (or send 0)", (None, 0, 0.0)),
    "length_penalty": Unsupported(_SAMPLER, (None, 1, 1.0)),
    "use_beam_search": Unsupported("beam search is not implemented; leave use_beam_search out", (None, False)),
    "best_of": Unsupported("only best_of 1 is supported; send several requests instead", (None, 1)),
    "allowed_token_ids": Unsupported("allowed_token_ids is not implemented; use logit_bias to ban tokens"),
    "bad_words": Unsupported("bad_words is not implemented; use logit_bias to ban tokens", (None, [])),
    "include_stop_str_in_output": Unsupported("stop strings are always cut from the text; leave it out", (None, False)),
    "skip_special_tokens": Unsupported("special tokens are always skipped in the text; leave it out", (None, True)),
    "truncate_prompt_tokens": Unsupported("prompts are never truncated; shorten the prompt yourself"),
    "prompt_logprobs": Unsupported("use echo: true with logprobs on /v1/completions to score the prompt"),
    "top_logprobs": Unsupported("use logprobs on /v1/completions", (None, 0)),
    "echo": Unsupported("echo is implemented on /v1/completions only; leave it out", (None, False), chat_only=True),
    "chat_template": Unsupported(_TEMPLATE),
    "chat_template_kwargs": Unsupported(_TEMPLATE, (None, {})),
    "add_generation_prompt": Unsupported(_TEMPLATE, (None, True)),
    "continue_final_message": Unsupported(_TEMPLATE, (None, False)),
    "documents": Unsupported(_TEMPLATE),
    "reasoning_effort": Unsupported("reasoning effort is not implemented; leave it out"),
    "prediction": Unsupported("predicted outputs are not implemented; leave prediction out"),
    "audio": Unsupported("audio output is not implemented; leave audio out"),
    "modalities": Unsupported("only text output is implemented; leave modalities out", (None, ["text"])),
}


def check_supported(fields: dict[str, Any], chat: bool) -> None:
    """APIError 400 naming the first parameter of ``fields`` (the request's values, extra ones included) that asks
    for something not implemented."""
    for name, value in fields.items():
        rule = UNSUPPORTED.get(name)
        if rule is None or (rule.chat_only and not chat) or _neutral(value, rule.neutral):
            continue
        where = "chat completions" if chat else "completions"
        message = f"{name} is not supported on {where} by this server: {rule.fix.format(name=name)}"
        raise APIError(400, message, param=name, code="unsupported_parameter")


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)
