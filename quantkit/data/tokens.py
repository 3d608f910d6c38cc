"""Tokenizing documents into one token stream, with the tokenizer's own BOS convention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantkit.progress import progress_bar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BATCH = 64


def bos_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """[bos] when the tokenizer defines a BOS token and adds it when encoding by default, else []."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if ids and ids[0] == bos else []


def encode_documents(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], *, show_progress: bool = True, description: str = "Tokenizing"
) -> list[list[int]]:
    """Token ids of each document, without special tokens."""
    out: list[list[int]] = []
    with progress_bar(show_progress) as bar:
        task = bar.add_task(description, total=len(texts))
        for start in range(0, len(texts), _BATCH):
            batch = texts[start : start + _BATCH]
            out.extend(tokenizer(batch, add_special_tokens=False)["input_ids"])
            bar.advance(task, len(batch))
    return out


def join_documents(docs: list[list[int]], separator: int | None) -> list[int]:
    """Concatenate documents, with ``separator`` (usually EOS) between them when given."""
    stream: list[int] = []
    for i, doc in enumerate(docs):
        if i and separator is not None:
            stream.append(separator)
        stream.extend(doc)
    return stream
