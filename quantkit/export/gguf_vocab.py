"""Tokenizer and chat-template metadata of a GGUF file, read from a checkpoint's HF tokenizer files.

Only byte-level BPE ``tokenizer.json`` files are expressed (``tokenizer.ggml.model = "gpt2"``). llama.cpp's
converter (convert_hf_to_gguf.py, ``get_vocab_base`` and gguf-py's ``SpecialVocab``) fills the same keys:
tokens by id padded to the model's vocab size with ``[PAD<i>]`` (UNUSED), added tokens CONTROL when special (or
shaped like ``<|...|>``) and USER_DEFINED otherwise, merges as ``"left right"`` strings, special ids from
``tokenizer_config.json`` then ``config.json``. Its ``tokenizer.ggml.pre`` comes from a hash of token ids over a
probe text; here it comes from the pre-tokenizer that ``tokenizer.json`` declares (see :data:`PRE_TOKENIZERS`),
the regular expressions llama.cpp implements for each name (src/llama-vocab.cpp).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from quantkit.errors import QuantkitError

# The pre-tokenizer regexes of tokenizer.json files (as llama.cpp's llama-vocab.cpp quotes them).
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = _WORDS + r"\p{N}{1,3}" + _REST  # numbers in runs of up to 3 digits
QWEN2_REGEX = _WORDS + r"\p{N}" + _REST  # one digit at a time

# Pre-tokenizer steps (see :func:`pre_tokenizer_steps`) -> llama.cpp's tokenizer.ggml.pre name.
PRE_TOKENIZERS: dict[tuple[tuple[str, ...], ...], str] = {
    (("split", LLAMA3_REGEX), ("bytelevel", "noregex")): "llama-bpe",  # Llama 3.x
    (("split", QWEN2_REGEX), ("bytelevel", "noregex")): "qwen2",  # Qwen2, Qwen2.5, Qwen3
    (("digits", "individual"), ("bytelevel", "gpt2")): "smollm",  # SmolLM, SmolLM2 (llama.cpp's StarCoder regex)
    (("bytelevel", "gpt2"),): "gpt-2",
}
SINGLE_DIGITS = "smollm"  # GPT-2 regex with digits split one by one

NORMAL, CONTROL, USER_DEFINED, UNUSED = (
    int(gguf.TokenType.NORMAL),
    int(gguf.TokenType.CONTROL),
    int(gguf.TokenType.USER_DEFINED),
    int(gguf.TokenType.UNUSED),
)
SPECIAL_TYPES = ("bos", "eos", "unk", "pad")


@dataclass(slots=True)
class Vocab:
    """Everything the GGUF tokenizer keys hold."""

    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]  # bos/eos/unk/pad -> id
    add_bos: bool
    add_eos: bool | None  # None: not written (the converter writes it only when it knows)
    chat_template: str | None
    add_space_prefix: bool | None = None  # tokenizer_config's add_prefix_space (llama arch writes it)
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{path} cannot be read as JSON ({exc}); restore the tokenizer files") from exc
    return data if isinstance(data, dict) else {}


def _tokenizer_json(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise QuantkitError(
            f"{directory} has no tokenizer.json; GGUF export writes byte-level BPE tokenizers from tokenizer.json "
            "only (a SentencePiece tokenizer.model cannot be expressed); copy the model's tokenizer.json into it"
        )
    return _read_json(path)


def _step(pre: dict[str, Any]) -> tuple[str, ...]:
    """One pre-tokenizer as a comparable tuple."""
    kind = pre.get("type")
    if kind == "ByteLevel":
        return ("bytelevel", "gpt2" if pre.get("use_regex", True) else "noregex")
    if kind == "Digits":
        return ("digits", "individual" if pre.get("individual_digits") else "grouped")
    if kind == "Split":
        pattern = pre.get("pattern") or {}
        return ("split", str(pattern.get("Regex", pattern.get("String", ""))))
    return (str(kind),)


def pre_tokenizer_steps(tokenizer: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    """The pre-tokenizer of a tokenizer.json as a tuple of steps (a Sequence flattened)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre] if pre else []
    return tuple(_step(p) for p in parts)


def _digits_split_by_vocab(tokenizer: dict[str, Any]) -> bool:
    """True when no token holds a digit next to anything else: the vocabulary was trained with digits split one
    by one, as SmolLM's (a transformers GGUF round trip keeps its vocabulary but drops the Digits step)."""
    vocab = tokenizer.get("model", {}).get("vocab", {})
    has_digit = [tok for tok in vocab if re.search(r"\d", tok)]
    return bool(has_digit) and all(len(tok) == 1 for tok in has_digit)


def pre_tokenizer_name(tokenizer: dict[str, Any]) -> str | None:
    """llama.cpp's tokenizer.ggml.pre for a byte-level BPE tokenizer.json, None when unknown."""
    name = PRE_TOKENIZERS.get(pre_tokenizer_steps(tokenizer))
    if name == "gpt-2" and _digits_split_by_vocab(tokenizer):
        return SINGLE_DIGITS
    return name


def _is_byte_level(tokenizer: dict[str, Any]) -> bool:
    steps = pre_tokenizer_steps(tokenizer)
    decoder = tokenizer.get("decoder") or {}
    return any(step[0] == "bytelevel" for step in steps) or decoder.get("type") == "ByteLevel"


def check_tokenizer(directory: Path, tokenizer_pre: str | None = None, vocab_size: int | None = None) -> None:
    """QuantkitError unless the tokenizer can be written as GGUF ``gpt2`` metadata (``vocab_size``: the model's)."""
    tokenizer = _tokenizer_json(directory)
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(tokenizer):
        raise QuantkitError(
            f"{directory}/tokenizer.json is a {model.get('type', 'unknown')} tokenizer without byte-level "
            "pre-tokenization; GGUF export writes byte-level BPE tokenizers (tokenizer.ggml.model gpt2) only; "
            "convert the float model with llama.cpp's convert_hf_to_gguf.py instead"
        )
    if tokenizer_pre is None and pre_tokenizer_name(tokenizer) is None:
        raise QuantkitError(
            f"{directory}/tokenizer.json has a pre-tokenizer llama.cpp knows under no name this exporter can tell "
            f"({pre_tokenizer_steps(tokenizer)}); pass tokenizer_pre=<llama.cpp name> (e.g. 'llama-bpe', "
            "'qwen2', 'gpt-2') if you know it"
        )
    if vocab_size is not None and _max_token_id(tokenizer) >= vocab_size:
        raise QuantkitError(
            f"{directory}/tokenizer.json has token id {_max_token_id(tokenizer)} but config.json's vocab_size is "
            f"{vocab_size}; the tokenizer does not belong to this model, copy the model's own tokenizer files"
        )


def _added_tokens(tokenizer: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(t["id"]): t for t in tokenizer.get("added_tokens", []) if "id" in t and "content" in t}


def _max_token_id(tokenizer: dict[str, Any]) -> int:
    ids = [int(i) for i in tokenizer.get("model", {}).get("vocab", {}).values()] + list(_added_tokens(tokenizer))
    return max(ids, default=-1)


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def tokens_and_types(tokenizer: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id, padded to ``vocab_size``, with llama.cpp's token types."""
    by_id: dict[int, str] = {int(i): tok for tok, i in tokenizer.get("model", {}).get("vocab", {}).items()}
    added = _added_tokens(tokenizer)
    by_id.update({i: t["content"] for i, t in added.items()})
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            special = bool(added[i].get("special")) or _looks_special(by_id[i])
            tokens.append(by_id[i])
            types.append(CONTROL if special else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    return tokens, types


def merges_of(tokenizer: dict[str, Any]) -> list[str]:
    """BPE merges as ``"left right"``; a space inside a part (pair format) is written as U+0120 as llama.cpp does."""
    merges = tokenizer.get("model", {}).get("merges") or []
    if merges and isinstance(merges[0], list):
        return [" ".join(part.replace(" ", chr(ord(" ") + 256)) for part in pair) for pair in merges]
    return [str(m) for m in merges]


def _token_content(entry: object) -> str | None:
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def special_token_ids(tokenizer: dict[str, Any], tokenizer_config: dict[str, Any], config: dict[str, Any]) -> dict:
    """bos/eos/unk/pad ids: tokenizer_config's token text looked up in the added tokens, else config.json's id."""
    by_content = {t["content"]: i for i, t in sorted(_added_tokens(tokenizer).items(), reverse=True)}
    ids: dict[str, int] = {}
    for kind in SPECIAL_TYPES:
        content = _token_content(tokenizer_config.get(f"{kind}_token"))
        token_id = by_content.get(content) if content is not None else None
        if token_id is None:
            token_id = config.get(f"{kind}_token_id")
        if isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0:
            ids[kind] = token_id
    return ids


def adds_special_tokens(directory: Path, tokenizer_config: dict[str, Any], special_ids: dict[str, int]) -> tuple:
    """(add_bos, add_eos): what the fast tokenizer does to a plain text, unless tokenizer_config says otherwise;
    add_eos None when neither adds nor asks for it."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode("a", add_special_tokens=True).ids
    add_bos = bool(ids) and "bos" in special_ids and ids[0] == special_ids["bos"]
    add_eos = True if len(ids) > 1 and "eos" in special_ids and ids[-1] == special_ids["eos"] else None
    if isinstance(tokenizer_config.get("add_bos_token"), bool):
        add_bos = tokenizer_config["add_bos_token"]
    if isinstance(tokenizer_config.get("add_eos_token"), bool):
        add_eos = tokenizer_config["add_eos_token"]
    return add_bos, add_eos


def chat_template_of(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """tokenizer_config's chat_template, else chat_template.jinja, else chat_template.json's."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return template
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if (directory / "chat_template.json").is_file():
        template = _read_json(directory / "chat_template.json").get("chat_template")
        return template if isinstance(template, str) else None
    return None


def read_vocab(directory: Path, config: dict[str, Any], tokenizer_pre: str | None = None) -> Vocab:
    """The tokenizer metadata of the checkpoint at ``directory`` (call :func:`check_tokenizer` first)."""
    vocab_size = int(config.get("vocab_size") or 0) or None
    check_tokenizer(directory, tokenizer_pre, vocab_size)
    tokenizer = _tokenizer_json(directory)
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = _read_json(config_path) if config_path.is_file() else {}
    tokens, types = tokens_and_types(tokenizer, vocab_size or _max_token_id(tokenizer) + 1)
    special_ids = special_token_ids(tokenizer, tokenizer_config, config)
    add_bos, add_eos = adds_special_tokens(directory, tokenizer_config, special_ids)
    detected = pre_tokenizer_name(tokenizer)
    pre = tokenizer_pre or detected or ""
    notes = [f"tokenizer.ggml.pre = '{pre}' ({'given' if tokenizer_pre else 'from tokenizer.json'})"]
    if tokenizer_pre and detected and tokenizer_pre != detected:
        notes.append(f"tokenizer_pre '{tokenizer_pre}' overrides '{detected}' read from tokenizer.json")
    prefix = tokenizer_config.get("add_prefix_space")
    return Vocab(
        pre=pre,
        tokens=tokens,
        token_types=types,
        merges=merges_of(tokenizer),
        special_ids=special_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=chat_template_of(directory, tokenizer_config),
        add_space_prefix=prefix if isinstance(prefix, bool) else None,
        notes=notes,
    )


def add_vocab(writer: gguf.GGUFWriter, vocab: Vocab, *, space_prefix_key: bool) -> None:
    """Write the tokenizer keys (``space_prefix_key``: llama's converter also writes add_space_prefix)."""
    if space_prefix_key and vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for kind, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.add_eos is not None:
        writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
