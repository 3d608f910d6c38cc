"""Perplexity over windows of held-out text and, against a reference model, the reference's own perplexity, the
change in percent, KL divergence and top-1 agreement.

Memory stays bounded: each forward pass covers ``batch_size`` windows (default 1), and each window's logits are
reduced to sums (NLL, KL, top-1 matches) a chunk of positions at a time before the next pass; no full-vocabulary
logits of earlier windows are kept.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
from quantkit.data.tokens import bos_prefix, encode_documents, join_documents
from quantkit.device import DEFAULT_DEVICE, resolve_device
from quantkit.errors import QuantkitError
from quantkit.eval.behaviour import BehaviourConfig, check_chat_template, measure_behaviour
from quantkit.eval.logit_metrics import RunningMetrics
from quantkit.eval.noise import compare_metrics, standard_errors
from quantkit.memory import release_freed_memory
from quantkit.progress import progress_bar

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # input_ids [B, T] -> logits [B, T, V]

# Windows scored unless told otherwise (None: every window), for the CLI, the Python API and recipes alike.
# 40 windows of 512 tokens score about 20,000 tokens of the held-out text, enough to rank 4-bit schemes of a
# small model; the whole shipped text (210 windows) takes five times as long.
DEFAULT_EVAL_WINDOWS = 40


@dataclass
class EvalConfig:
    """How to evaluate; the model is the caller's argument."""

    dataset: str | None = None  # file, directory or HF dataset; None: the shipped held-out evaluation text
    seq_len: int = 512
    max_windows: int | None = DEFAULT_EVAL_WINDOWS  # None: every window of the text
    stride: int | None = None  # None: non-overlapping windows
    reference: str | None = None  # a model to measure KL divergence and top-1 agreement against
    compare: str | None = None  # a second model scored on the same windows: paired differences with the first
    text_column: str = "text"
    batch_size: int = 1  # windows per forward pass; each holds [seq_len, vocab] logits per model while scored
    device: str = DEFAULT_DEVICE  # where the models run and the windows are scored (quantkit.device)
    behaviour: BehaviourConfig | None = None  # greedy replies to the shipped chat prompts, against the reference
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
        resolve_device(self.device)
        if self.behaviour is not None:
            if self.reference is None:
                raise QuantkitError("--behaviour compares replies with a reference model's; add --reference MODEL")
            self.behaviour.validate()


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
    reference_perplexity: float | None = None  # the reference's perplexity over the same tokens
    perplexity_change_pct: float | None = None  # (perplexity / reference_perplexity - 1) * 100
    # standard errors over windows (quantkit/eval/noise.py); the change's is paired with the reference
    perplexity_se: float | None = None
    perplexity_change_se: float | None = None  # in percentage points
    kl_mean_se: float | None = None
    top1_se: float | None = None
    comparison: dict | None = None  # --compare: the other model's figures and the paired differences
    behaviour: dict | None = None  # --behaviour: quantkit.eval.behaviour.BehaviourResult as data

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
    batch_size: int = 1,
    show_progress: bool = True,
) -> RunningMetrics:
    """Accumulate NLL (and the reference's NLL, KL and top-1 against it) over the scored positions of every
    window, ``batch_size`` windows per forward pass; each pass's logits are reduced before the next."""
    metrics = RunningMetrics()
    with progress_bar(show_progress) as bar, torch.inference_mode():
        task = bar.add_task("Evaluating", total=len(windows))
        for i in range(0, len(windows), batch_size):
            batch = windows[i : i + batch_size]
            ids = torch.tensor([w.input_ids for w in batch], dtype=torch.long)
            reference = reference_fn(ids) if reference_fn is not None else None
            logits = logits_fn(ids)
            for row, window in enumerate(batch):
                first = window.first_scored
                metrics.add_window(
                    logits[row, first - 1 : -1],
                    ids[row, first:].to(logits.device),
                    None if reference is None else reference[row, first - 1 : -1],
                )
            del logits, reference  # before the next pass allocates its own
            release_freed_memory()  # freed log-softmax chunks would otherwise stay resident, window after window
            bar.advance(task, len(batch))
    return metrics


def model_logits_fn(model) -> LogitsFn:
    """Logits of ``model`` for token ids, the ids moved to the model's device (the logits stay there)."""
    device = next(model.parameters()).device

    def run(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids.to(device), use_cache=False).logits.float()

    return run


def evaluate(model: str | Path, config: EvalConfig | None = None) -> EvalResult:
    """Perplexity of ``model`` (a float model or a quantized checkpoint) on held-out text; with
    ``config.reference``, the reference's perplexity on the same tokens, the change in percent, KL divergence
    and top-1 agreement against that model."""
    from quantkit.model.resolve import arch_for_dir, load_model, load_tokenizer, resolve_model, tokenizer_fingerprint

    config = config or EvalConfig()
    config.validate()
    name = str(model)
    start = time.perf_counter()
    arch_for_dir(resolve_model(name))  # an unsupported architecture fails before any work
    tokenizer = load_tokenizer(name)
    if config.behaviour is not None:
        check_chat_template(tokenizer, name)  # before any work, not after the perplexity pass
    dataset = config.dataset if config.dataset is not None else str(DEFAULT_EVALUATION)
    docs = load_documents(dataset, text_column=config.text_column)
    stream = join_documents(
        encode_documents(tokenizer, docs.texts, show_progress=config.show_progress), tokenizer.eos_token_id
    )
    prefix = bos_prefix(tokenizer)
    stride = config.stride or config.seq_len - len(prefix)
    windows = make_windows(stream, config.seq_len, stride, prefix, config.max_windows)
    # both scored on this model's tokens: an unsupported architecture or another vocabulary fails before any work
    for role, other, why in (
        ("reference", config.reference, "KL divergence needs the same vocabulary"),
        ("--compare", config.compare, "a paired comparison scores the same tokens with both; use one tokenizer"),
    ):
        if other is not None:
            arch_for_dir(resolve_model(other))
            if tokenizer_fingerprint(load_tokenizer(other)) != tokenizer_fingerprint(tokenizer):
                raise QuantkitError(f"{role} '{other}' uses a different tokenizer from '{name}'; {why}")
    device = resolve_device(config.device)
    loaded = load_model(name, device=device)
    reference_fn = reference = None
    if config.reference is not None:
        same = resolve_model(config.reference) == resolve_model(name)
        reference = loaded if same else load_model(config.reference, device=device)  # one copy of a model
        reference_fn = model_logits_fn(reference)
    torch.set_num_threads(_threads())
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
        result.reference_perplexity = metrics.reference_perplexity
        result.perplexity_change_pct = perplexity_change_pct(result.perplexity, metrics.reference_perplexity)
    for figure, value in standard_errors(metrics).items():
        setattr(result, figure, value)
    if config.compare is not None:
        other = load_model(config.compare, device=device)
        other_metrics = score_windows(
            model_logits_fn(other),
            windows,
            reference_fn=reference_fn,
            batch_size=config.batch_size,
            show_progress=config.show_progress,
        )
        result.comparison = compare_metrics(config.compare, metrics, other_metrics)
    if config.behaviour is not None:
        behaviour = replace(config.behaviour, show_progress=config.show_progress and config.behaviour.show_progress)
        result.behaviour = measure_behaviour(loaded, tokenizer, reference, behaviour, name=name).to_dict()
    result.seconds = time.perf_counter() - start
    return result


def _threads() -> int:
    """Every core, unless the user capped the threads with OMP_NUM_THREADS (a machine shared with other jobs)."""
    capped = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(capped) if capped.isdigit() and int(capped) > 0 else max(1, os.cpu_count() or 1)


def perplexity_change_pct(perplexity: float, reference_perplexity: float | None) -> float | None:
    """How much higher ``perplexity`` is than the reference's, in percent (negative: lower)."""
    if reference_perplexity is None:
        return None
    return (perplexity / reference_perplexity - 1.0) * 100.0
