"""Perplexity over windows of held-out text and, against a reference model, KL divergence and top-1 agreement."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
from quantkit.data.tokens import bos_prefix, encode_documents, join_documents
from quantkit.errors import QuantkitError
from quantkit.eval.logit_metrics import RunningMetrics, token_nll
from quantkit.progress import progress_bar

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # input_ids [B, T] -> logits [B, T, V]


@dataclass
class EvalConfig:
    """How to evaluate; the model is the caller's argument."""

    dataset: str | None = None  # file, directory or HF dataset; None: the shipped held-out evaluation text
    seq_len: int = 512
    max_windows: int | None = None  # None: every window of the text
    stride: int | None = None  # None: non-overlapping windows
    reference: str | None = None  # a model to measure KL divergence and top-1 agreement against
    text_column: str = "text"
    batch_size: int = 4
    show_progress: bool = True

    def validate(self) -> None:
        if self.seq_len < 2:
            raise QuantkitError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.max_windows is not None and self.max_windows < 1:
            raise QuantkitError(f"--max-windows must be at least 1, got {self.max_windows}")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            raise QuantkitError(f"--stride must be between 1 and --seq-len ({self.seq_len}), got {self.stride}")
        if self.batch_size < 1:
            raise QuantkitError(f"--batch-size must be at least 1, got {self.batch_size}")


@dataclass(slots=True, frozen=True)
class Window:
    input_ids: list[int]
    first_scored: int  # logits at positions >= first_scored - 1 predict scored tokens


@dataclass(slots=True)
class EvalResult:
    model: str
    dataset: str
    dataset_hash: str
    seq_len: int
    stride: int
    windows: int
    tokens: int
    perplexity: float
    seconds: float
    reference: str | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def make_windows(
    stream: list[int], seq_len: int, stride: int, prefix: list[int], max_windows: int | None
) -> list[Window]:
    """Windows from the start of the stream; each token is scored once.

    With ``stride == body`` (body = seq_len - len(prefix)) windows do not overlap; a smaller stride slides the
    window and scores only the tokens the previous window did not. Without a BOS prefix a window's first token
    has no context and is not scored.
    """
    body = seq_len - len(prefix)
    if body < 1 or stride > body:
        raise QuantkitError(f"--stride {stride} must not exceed the window body of {body} tokens")
    if len(stream) < body:
        raise QuantkitError(
            f"the evaluation text has {len(stream)} tokens, fewer than one window of {body}; lower --seq-len"
        )
    windows: list[Window] = []
    scored_until = 0  # stream tokens before this index were scored by an earlier window
    start = 0
    while start + body <= len(stream):
        if max_windows is not None and len(windows) >= max_windows:
            break
        end = start + body
        first = max(1, len(prefix) + max(scored_until - start, 0))
        windows.append(Window(prefix + stream[start:end], first))
        scored_until = end
        start += stride
    return windows


def score_windows(
    logits_fn: LogitsFn,
    windows: list[Window],
    *,
    reference_fn: LogitsFn | None = None,
    batch_size: int = 4,
    show_progress: bool = True,
) -> RunningMetrics:
    """Accumulate NLL (and KL/top-1 against the reference) over scored positions of every window."""
    metrics = RunningMetrics()
    with progress_bar(show_progress) as bar, torch.inference_mode():
        task = bar.add_task("Evaluating", total=len(windows))
        for i in range(0, len(windows), batch_size):
            batch = windows[i : i + batch_size]
            ids = torch.tensor([w.input_ids for w in batch], dtype=torch.long)
            logits = logits_fn(ids)
            reference = reference_fn(ids) if reference_fn is not None else None
            for row, window in enumerate(batch):
                first = window.first_scored
                predicted = logits[row, first - 1 : -1]
                metrics.add_nll(token_nll(predicted, ids[row, first:]))
                if reference is not None:
                    metrics.add_reference(reference[row, first - 1 : -1], predicted)
            bar.advance(task, len(batch))
    return metrics


def model_logits_fn(model) -> LogitsFn:
    def run(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits.float()

    return run


def evaluate(model: str | Path, config: EvalConfig | None = None) -> EvalResult:
    """Perplexity of ``model`` (a float model or a quantized checkpoint) on held-out text; with
    ``config.reference``, KL divergence and top-1 agreement against that model."""
    from quantkit.model.resolve import arch_for_dir, load_model, load_tokenizer, resolve_model, tokenizer_fingerprint

    config = config or EvalConfig()
    config.validate()
    name = str(model)
    start = time.perf_counter()
    arch_for_dir(resolve_model(name))  # an unsupported architecture fails before any work
    tokenizer = load_tokenizer(name)
    dataset = config.dataset if config.dataset is not None else str(DEFAULT_EVALUATION)
    docs = load_documents(dataset, text_column=config.text_column)
    stream = join_documents(
        encode_documents(tokenizer, docs.texts, show_progress=config.show_progress), tokenizer.eos_token_id
    )
    prefix = bos_prefix(tokenizer)
    stride = config.stride or config.seq_len - len(prefix)
    windows = make_windows(stream, config.seq_len, stride, prefix, config.max_windows)
    loaded = load_model(name)
    reference_fn = None
    if config.reference is not None:
        if tokenizer_fingerprint(load_tokenizer(config.reference)) != tokenizer_fingerprint(tokenizer):
            raise QuantkitError(
                f"reference '{config.reference}' uses a different tokenizer from '{name}'; "
                "KL divergence needs the same vocabulary"
            )
        reference_fn = model_logits_fn(load_model(config.reference))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    metrics = score_windows(
        model_logits_fn(loaded),
        windows,
        reference_fn=reference_fn,
        batch_size=config.batch_size,
        show_progress=config.show_progress,
    )
    result = EvalResult(
        model=name,
        dataset=docs.source if config.dataset is not None else f"shipped:{DEFAULT_EVALUATION.name}",
        dataset_hash=docs.content_hash,
        seq_len=config.seq_len,
        stride=stride,
        windows=len(windows),
        tokens=metrics.tokens,
        perplexity=metrics.perplexity,
        seconds=0.0,
        reference=config.reference,
    )
    if reference_fn is not None:
        result.kl_mean, result.kl_p99, result.top1_agreement = metrics.kl_summary()
    result.seconds = time.perf_counter() - start
    return result
