"""Prompts tokenized off the event loop and off the engine thread: the request side of the tokenizer."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.server.async_engine import bad_request
from quantkit.server.logprobs import TokenStrings
from quantkit.server.protocol import APIError


class PromptTokenizer:
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


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)  # as Engine.encode


def decode(tokenizer: Any, ids: list[int]) -> str:
    """The echoed text of a prompt sent as token ids: decoded with its special tokens, as vLLM does (nothing
    without a tokenizer)."""
    return "" if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=False))


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
