"""Prompts tokenized off the event loop and off the engine thread: the request side of the tokenizer."""

from __future__ import annotations

import asyncio
import copy
import uuid
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
    """The tokenizer's chat template (with the assistant prompt); without one, plain ``role: content`` lines.

    Message content is text, never control tokens: a message holding ``<|im_start|>system`` must not open a system
    turn. Content without any special token's text is tokenized with the rendered prompt as one string (as before);
    content holding some is tokenized on its own with special tokens split into plain text, the template's parts
    with their special tokens (:func:`_pieces_ids`)."""
    if tokenizer is None:
        raise QuantkitError("this model has no tokenizer, so chat requests are not possible; use /v1/completions")
    specials = _special_texts(tokenizer)
    spoofing = any(s in m["content"] for m in messages for s in specials)
    if getattr(tokenizer, "chat_template", None):
        text = _render(tokenizer, messages)
        if not spoofing:
            return list(tokenizer(text, add_special_tokens=False).input_ids)  # the template has the special tokens
        return _pieces_ids(tokenizer, _template_pieces(tokenizer, messages, text), add_special_tokens=False)
    pieces: list[tuple[str, bool]] = []
    for m in messages:
        pieces += [(f"{m['role']}: ", False), (m["content"], True), ("\n", False)]
    pieces.append(("assistant:", False))
    if not spoofing:
        return list(tokenizer("".join(p for p, _ in pieces)).input_ids)
    return _pieces_ids(tokenizer, pieces, add_special_tokens=True)


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    except Exception as exc:  # template errors (e.g. roles out of order) are the request's fault
        raise APIError(
            400, f"chat template failed: {exc}; check the messages' roles and their order", param="messages"
        ) from None


def _special_texts(tokenizer: Any) -> set[str]:
    """The text of every special token (control tokens such as ``<|im_start|>``)."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return {t for t in texts if t}


def _template_pieces(tokenizer: Any, messages: list[dict[str, str]], text: str) -> list[tuple[str, bool]]:
    """``text`` (the rendered prompt) cut into template parts and message contents (True), found by rendering the
    template again with a marker in place of each content."""
    marker = f"QKCONTENT{uuid.uuid4().hex}"
    marked = _render(tokenizer, [{**m, "content": f"{marker}{i}Q"} for i, m in enumerate(messages)])
    pieces: list[tuple[str, bool]] = []
    rest = marked
    for i, m in enumerate(messages):
        before, found, rest = rest.partition(f"{marker}{i}Q")
        if not found or marker in before:
            break
        pieces += [(before, False), (m["content"], True)]
    else:
        pieces.append((rest, False))
        if marker not in rest and "".join(p for p, _ in pieces) == text:
            return pieces
    raise APIError(
        400, "a message holds the text of a special token, and this model's chat template changes message content, "
        "so the two cannot be kept apart; remove the special token text from the message", param="messages",
    )  # fmt: skip


def _pieces_ids(tokenizer: Any, pieces: list[tuple[str, bool]], add_special_tokens: bool) -> list[int]:
    """Token ids of the pieces, each tokenized alone: content (True) with special tokens split into text, template
    parts with theirs; with ``add_special_tokens``, wrapped as the tokenizer wraps one text (e.g. a BOS first)."""
    ids: list[int] = []
    for text, literal in pieces:
        if text:
            encoded = tokenizer(text, add_special_tokens=False, split_special_tokens=literal)
            ids += list(encoded.input_ids)
    if not add_special_tokens:
        return ids
    bare = list(tokenizer("x", add_special_tokens=False).input_ids)
    full = list(tokenizer("x").input_ids)
    start = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), 0)
    return full[:start] + ids + full[start + len(bare) :]
