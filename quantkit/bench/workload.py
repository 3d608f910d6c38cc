"""A fixed, seeded workload: prompts cut from the shipped held-out text (*Persuasion*), varied output lengths.

Kinds: ``free`` continues a passage of token ids (as ``scripts/bench_serve.py`` always did); ``copy`` puts whole
sentences in an instruction to repeat them word for word (the tokenizer's chat template when it has one) and starts
the answer with the passage's first words, so the output quotes long spans of the prompt (what prompt lookup
speculation feeds on; with SmolLM2-135M-Instruct, greedy, ~84% of output tokens lie in 4-token runs of the prompt,
~62% without the started answer); ``mixed`` alternates the two.
Every request fits ``max_model_len``; the same tokenizer, kind, count and seed give the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from quantkit.data.sources import DEFAULT_EVALUATION
from quantkit.errors import QuantkitError

KINDS = ("free", "copy", "mixed")
PROMPT_LENS = (12, 24, 40, 64, 96, 128, 160, 200)  # free: prompt tokens, cycled
MAX_TOKENS = (16, 32, 48, 64, 96, 128)  # free: completion tokens at most, drawn
COPY_WORDS = (24, 40, 64, 96)  # copy: passage words, cycled
COPY_SLACK = 16  # copy: completion tokens allowed beyond the passage's own
PRIMED_WORDS = 3  # copy: the answer starts with the passage's first words (quote, then go on)
SENTENCE_ENDS = (".", "!", "?", '."', '!"', '?"')
TEXT_CHARS = 200_000
INSTRUCTION = "Repeat the following passage exactly, word for word, without changing anything."


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: list[int]  # token ids
    max_tokens: int
    kind: str  # "free" or "copy"


def make_workload(
    tokenizer: Any, n: int, kind: str = "free", seed: int = 0, max_model_len: int = 4096
) -> list[BenchRequest]:
    """``n`` requests of ``kind`` (see the module docstring), each with prompt + max_tokens <= ``max_model_len``."""
    if kind not in KINDS:
        raise QuantkitError(f"workload {kind!r} is invalid; use one of {list(KINDS)}")
    if n < 1:
        raise QuantkitError(f"requests={n} is invalid; use an integer >= 1")
    text = DEFAULT_EVALUATION.read_text(encoding="utf-8")[:TEXT_CHARS]
    rng = random.Random(seed)
    ids: list[int] = list(tokenizer(text).input_ids) if kind != "copy" else []
    words = text.split()
    out = []
    for i in range(n):
        if kind == "free" or (kind == "mixed" and i % 2 == 0):
            out.append(_free(ids, rng, PROMPT_LENS[i % len(PROMPT_LENS)], max_model_len))
        else:
            out.append(
                _copy(
                    tokenizer,
                    words,
                    rng,
                    COPY_WORDS[(i // 2 if kind == "mixed" else i) % len(COPY_WORDS)],
                    max_model_len,
                )
            )
    return out


def _free(ids: list[int], rng: random.Random, length: int, limit: int) -> BenchRequest:
    max_tokens = min(rng.choice(MAX_TOKENS), max(1, limit // 2))
    length = min(length, limit - max_tokens)
    start = rng.randrange(0, len(ids) - length)
    return BenchRequest(ids[start : start + length], max_tokens, "free")


def _copy(tokenizer: Any, words: list[str], rng: random.Random, num_words: int, limit: int) -> BenchRequest:
    start = rng.randrange(1, len(words) - num_words)
    while start > 1 and not words[start - 1].endswith(SENTENCE_ENDS):  # back to a sentence start
        start -= 1
    while True:  # shrink the passage until prompt + its copy fit the context
        end = start + num_words
        while end < len(words) and end - start < 2 * num_words and not words[end - 1].endswith(SENTENCE_ENDS):
            end += 1  # on to the sentence's end
        passage = " ".join(words[start:end])
        prompt = copy_prompt(tokenizer, passage)
        max_tokens = len(tokenizer(passage, add_special_tokens=False).input_ids) + COPY_SLACK
        if len(prompt) + max_tokens <= limit or num_words <= 1:
            return BenchRequest(prompt, max(1, min(max_tokens, limit - len(prompt))), "copy")
        num_words = num_words * 3 // 4


def copy_prompt(tokenizer: Any, passage: str) -> list[int]:
    """The instruction and the passage (a user turn of the chat template when there is one, else plain text), then
    the answer's start: the passage's first words."""
    primed = " ".join(passage.split()[:PRIMED_WORDS])
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{INSTRUCTION}\n\n{passage}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text + primed, add_special_tokens=False).input_ids)  # the template has the specials
    return list(tokenizer(f"{INSTRUCTION}\n\nPassage: {passage}\n\nRepeated: {primed}").input_ids)


def copied_fraction(prompt: list[int], output: list[int], n: int = 4) -> float:
    """Share of ``output`` tokens inside a run of ``n`` or more tokens that also occurs in ``prompt``."""
    if len(output) < n:
        return 0.0
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(output)
