"""Calibration token windows: sample them from documents, save and load them with their provenance."""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit import __version__
from quantkit.data.diverse import select_diverse
from quantkit.data.self_generated import SELF_GENERATED, generate_windows
from quantkit.data.sources import load_documents
from quantkit.data.tokens import bos_prefix, encode_documents, join_documents
from quantkit.errors import CalibrationError, QuantkitError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMAT = "quantkit-calibration/1"
_DIVERSE_POOL_FACTOR = 8


STRATEGIES = ("random", "document")
SELECTIONS = ("random", "diverse")

# Random windows over a text shorter than the request overlap: below 100% coverage (text tokens / requested
# tokens) a warning, below this floor a refusal unless forced. At 25% every text token lands in about four
# windows on average, so the run does at least four times the capture work of a request the text can actually
# fill, and its Hessian/activation sums rest on a quarter (or less) of the distinct positions asked for; a
# shortfall up to 4x is left to a warning because modest overlap only reweights real text.
MIN_TEXT_COVERAGE = 0.25
FORCE_SMALL_FLAG = "--allow-small-calibration"
FORCE_SMALL_RECIPE_KEY = "calibration.allow_small"


class SmallCalibrationWarning(UserWarning):
    """The calibration text is shorter than the tokens the windows ask for: windows overlap."""


@dataclass
class CalibrationConfig:
    """Which token windows to draw; the model (its tokenizer) is the caller's argument."""

    dataset: str | None = None  # file, directory or HF dataset; None: the shipped calibration corpus
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    strategy: str = "random"  # random windows over the joined text, or one window per document
    min_length: int | None = None  # document strategy: minimum document length in tokens (default seq_len)
    select: str = "random"  # or "diverse": TF-IDF + MiniBatchKMeans coverage of the text
    text_column: str = "text"
    allow_small: bool = False  # use a text that covers under MIN_TEXT_COVERAGE of the requested tokens
    show_progress: bool = True

    def validate(self) -> None:
        if self.num_samples < 1:
            raise QuantkitError(f"--num-samples must be at least 1, got {self.num_samples}")
        if self.seq_len < 2:
            raise QuantkitError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.strategy not in STRATEGIES:
            raise QuantkitError(f"unknown strategy '{self.strategy}'; use one of {', '.join(STRATEGIES)}")
        if self.select not in SELECTIONS:
            raise QuantkitError(f"unknown selection '{self.select}'; use one of {', '.join(SELECTIONS)}")
        if self.dataset == SELF_GENERATED and (self.strategy != "random" or self.select != "random"):
            raise QuantkitError(
                f"--dataset {SELF_GENERATED} generates each window, so --strategy and --select do not apply; drop them"
            )
        if self.min_length is not None and self.min_length < 1:
            raise QuantkitError(f"--min-length must be positive, got {self.min_length}")


@dataclass(slots=True)
class CalibrationSet:
    input_ids: torch.Tensor  # int64 [num_samples, seq_len]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def fingerprint(self) -> str:
        """Identity of the token windows (what a quantization run's statistics depend on)."""
        return hashlib.sha256(self.input_ids.numpy().tobytes()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        """Write under a temporary name, then rename: an interrupted save leaves nothing at ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            save_file({"input_ids": self.input_ids.to(torch.int32).contiguous()}, str(tmp), metadata=self.metadata)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> CalibrationSet:
        if not path.is_file():
            raise CalibrationError(f"calibration file '{path}' not found; create it with `quantkit calibrate`")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                ids = f.get_tensor("input_ids").long()
        except Exception as exc:  # safetensors raises several types on foreign files
            raise CalibrationError(f"'{path}' is not a quantkit calibration file ({exc})") from exc
        if metadata.get("format") != FORMAT:
            raise CalibrationError(f"'{path}' is not a quantkit calibration file; create it with `quantkit calibrate`")
        return cls(input_ids=ids, metadata=metadata)


@dataclass(slots=True)
class CalibrationResult:
    calibration: CalibrationSet
    seconds: float
    documents: int
    source_tokens: int


def build_calibration(
    model: str | Path,
    config: CalibrationConfig,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    output: Path | None = None,
) -> CalibrationResult:
    """Sample ``num_samples`` windows of ``seq_len`` tokens of ``model``'s tokenizer, deterministically for a seed;
    saved to ``output`` when given. ``tokenizer``: the model's, when the caller has it loaded already."""
    from quantkit.model.resolve import load_tokenizer, tokenizer_fingerprint

    config.validate()
    start = time.perf_counter()
    if tokenizer is None:
        tokenizer = load_tokenizer(model)
    prefix = bos_prefix(tokenizer)
    body = config.seq_len - len(prefix)
    if config.dataset == SELF_GENERATED:
        chosen = generate_windows(model, tokenizer, config.num_samples, body, config.seed)
        source, content_hash, documents, tokens = f"{SELF_GENERATED}-generated", "", len(chosen), len(chosen) * body
    else:
        chosen, source, content_hash, documents, tokens = _text_windows(config, tokenizer, body)
    ids = torch.tensor([prefix + window for window in chosen], dtype=torch.long)
    metadata = {
        "format": FORMAT,
        "quantkit_version": __version__,
        "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
        "tokenizer_hash": tokenizer_fingerprint(tokenizer),
        "source": source,
        "source_hash": content_hash,
        "params": json.dumps(
            {
                "num_samples": config.num_samples,
                "seq_len": config.seq_len,
                "seed": config.seed,
                "strategy": config.strategy,
                "min_length": config.min_length,
                "select": config.select,
                "text_column": config.text_column,
                "bos": bool(prefix),
            },
            sort_keys=True,
        ),
    }
    calibration = CalibrationSet(input_ids=ids, metadata=metadata)
    if output is not None:
        calibration.save(Path(output))
    return CalibrationResult(calibration, time.perf_counter() - start, documents, tokens)


@dataclass(frozen=True, slots=True)
class TextCoverage:
    """How much of a request for random windows the text can fill with distinct tokens."""

    text_tokens: int  # the joined text, separators included
    windows: int
    window_tokens: int  # tokens drawn from the text per window (the BOS prefix excluded)
    bytes_per_token: float  # measured on this text, to turn a token count into an amount of text
    words_per_token: float

    @classmethod
    def of(cls, texts: list[str], text_tokens: int, windows: int, window_tokens: int) -> TextCoverage:
        size = max(text_tokens, 1)
        text_bytes = sum(len(t.encode("utf-8")) for t in texts)
        words = sum(len(t.split()) for t in texts)
        return cls(text_tokens, windows, window_tokens, text_bytes / size, words / size)

    @property
    def requested_tokens(self) -> int:
        return self.windows * self.window_tokens

    @property
    def fraction(self) -> float:
        return self.text_tokens / self.requested_tokens

    def amount_needed(self) -> str:
        """The requested tokens as an amount of text like this one: '4,096 tokens (about 3,100 words, 18 KB)'."""
        need = self.requested_tokens
        words = _round2(need * self.words_per_token)
        kilobytes = max(1, round(need * self.bytes_per_token / 1000))
        return f"{need:,} tokens (about {words:,} words, {kilobytes:,} KB of text like this)"


def _text_windows(
    config: CalibrationConfig, tokenizer: PreTrainedTokenizerBase, body: int
) -> tuple[list[list[int]], str, str, int, int]:
    """Windows of ``body`` tokens drawn from ``config.dataset``'s text, with the text's source, content hash,
    document count and token count."""
    docs = load_documents(config.dataset, text_column=config.text_column, render_chat=_chat_renderer(tokenizer))
    encoded = encode_documents(tokenizer, docs.texts, show_progress=config.show_progress)
    generator = torch.Generator().manual_seed(config.seed)
    if config.strategy == "document":
        candidates = document_windows(encoded, body, config.min_length or body, generator)
    else:
        stream = join_documents(encoded, tokenizer.eos_token_id)
        if len(stream) >= body:  # a text shorter than one window gets random_windows' own message
            check_text_coverage(TextCoverage.of(docs.texts, len(stream), config.num_samples, body), config.allow_small)
        candidates = random_windows(stream, body, _pool_size(config), generator)
    if config.select == "diverse":
        chosen = select_diverse(candidates, config.num_samples, config.seed)
    else:
        chosen = candidates[: config.num_samples]
    if len(chosen) < config.num_samples and config.strategy == "document":
        raise CalibrationError(
            f"only {len(chosen)} documents have at least {config.min_length or body} tokens, "
            f"{config.num_samples} were asked for; lower --num-samples or --seq-len, or use --strategy random"
        )
    return chosen, docs.source, docs.content_hash, len(docs), sum(map(len, encoded))


def check_text_coverage(coverage: TextCoverage, allow_small: bool) -> None:
    """Refuse a text that covers under MIN_TEXT_COVERAGE of the requested tokens (unless ``allow_small``);
    warn (SmallCalibrationWarning) when it covers under all of them."""
    if coverage.fraction >= 1.0:
        return
    request = f"{coverage.windows} windows x {coverage.window_tokens} tokens"
    repeats = 1 / coverage.fraction
    if coverage.fraction < MIN_TEXT_COVERAGE and not allow_small:
        raise CalibrationError(
            f"the calibration text has {coverage.text_tokens:,} tokens, {coverage.fraction:.0%} of the "
            f"{coverage.requested_tokens:,} that {request} ask for (each token would be seen ~{repeats:.1f} times; "
            f"the floor is {MIN_TEXT_COVERAGE:.0%}); give at least {coverage.amount_needed()}, lower --num-samples "
            f"or --seq-len, or pass {FORCE_SMALL_FLAG} to use it anyway (recipes: {FORCE_SMALL_RECIPE_KEY}: true)"
        )
    warnings.warn(
        f"the calibration text has {coverage.text_tokens:,} tokens, fewer than the {coverage.requested_tokens:,} "
        f"that {request} ask for: windows overlap (each token seen ~{repeats:.1f} times on average); "
        f"{coverage.amount_needed()} would give distinct windows",
        SmallCalibrationWarning,
        stacklevel=3,
    )


def _round2(value: float) -> int:
    """``value`` rounded to two significant digits (an estimate should not look exact)."""
    if value < 100:
        return max(1, round(value))
    digits = len(str(int(value))) - 2
    return int(round(value, -digits))


def _pool_size(config: CalibrationConfig) -> int:
    return config.num_samples * (_DIVERSE_POOL_FACTOR if config.select == "diverse" else 1)


def random_windows(stream: list[int], length: int, count: int, generator: torch.Generator) -> list[list[int]]:
    """``count`` windows at uniformly random offsets of the token stream."""
    if len(stream) < length:
        raise CalibrationError(
            f"the dataset has {len(stream)} tokens, fewer than one window of {length}; lower --seq-len or add text"
        )
    starts = torch.randint(0, len(stream) - length + 1, (count,), generator=generator).tolist()
    return [stream[s : s + length] for s in starts]


def document_windows(
    docs: list[list[int]], length: int, min_length: int, generator: torch.Generator
) -> list[list[int]]:
    """One window per eligible document (at least ``max(min_length, length)`` tokens), in random order."""
    need = max(min_length, length)
    eligible = [d for d in docs if len(d) >= need]
    if not eligible:
        longest = max(map(len, docs))
        raise CalibrationError(
            f"no document has {need} tokens (the longest has {longest}); lower --seq-len/--min-length "
            "or use --strategy random"
        )
    order = torch.randperm(len(eligible), generator=generator).tolist()
    windows = []
    for i in order:
        doc = eligible[i]
        offset = int(torch.randint(0, len(doc) - length + 1, (1,), generator=generator))
        windows.append(doc[offset : offset + length])
    return windows


def _chat_renderer(tokenizer):
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)
