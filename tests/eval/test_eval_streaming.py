"""Evaluation streamed window by window: the same figures as an all-at-once computation, the reference's
perplexity and the change in percent in the result, and a table that keeps every word at 80 columns."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from quantkit.eval.evaluate import DEFAULT_EVAL_WINDOWS, EvalConfig, EvalResult, evaluate, make_windows, score_windows
from quantkit.eval.logit_metrics import CHUNK_POSITIONS, RunningMetrics, token_kl, token_nll
from quantkit.eval.report import eval_table


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    from helpers.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("other") / "model", seed=5)


def test_one_default_window_count_for_cli_api_and_recipes():
    from typer.main import get_command

    from quantkit.cli import app
    from quantkit.recipes.schema import EvaluationSection

    assert DEFAULT_EVAL_WINDOWS == 40
    assert EvalConfig().max_windows == DEFAULT_EVAL_WINDOWS
    assert EvaluationSection().windows == DEFAULT_EVAL_WINDOWS
    eval_command = get_command(app).commands["eval"]  # type: ignore[attr-defined]
    option = next(p for p in eval_command.params if p.name == "max_windows")
    assert option.default == DEFAULT_EVAL_WINDOWS


def test_add_window_in_chunks_equals_whole_window_figures():
    gen = torch.Generator().manual_seed(0)
    length, vocab = 2 * CHUNK_POSITIONS + 37, 50  # three chunks, the last one short
    logits = torch.randn(length, vocab, generator=gen) * 3
    reference = logits + torch.randn(length, vocab, generator=gen)
    targets = torch.randint(0, vocab, (length,), generator=gen)
    metrics = RunningMetrics()
    metrics.add_window(logits, targets, reference)
    nll = token_nll(logits, targets)
    kl = token_kl(reference, logits)
    assert metrics.tokens == metrics.reference_tokens == length
    assert metrics.nll_sum == pytest.approx(float(nll.sum()), rel=1e-12)
    assert metrics.reference_nll_sum == pytest.approx(float(token_nll(reference, targets).sum()), rel=1e-12)
    kl_mean, kl_p99, top1 = metrics.kl_summary()
    assert kl_mean == pytest.approx(float(kl.float().double().mean()), rel=1e-12)
    assert kl_p99 == pytest.approx(float(torch.quantile(kl.float().double(), 0.99)), rel=1e-12)
    assert top1 == float((reference.argmax(-1) == logits.argmax(-1)).double().mean())


def test_batch_size_does_not_change_the_figures():
    vocab = 23
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(vocab, vocab, generator=gen)  # logits depend on the current token only

    windows = make_windows([(i * 7) % vocab for i in range(300)], 20, 15, [], None)  # sliding windows
    one = score_windows(lambda ids: table[ids], windows, reference_fn=lambda ids: table[ids] * 0.5, show_progress=False)
    three = score_windows(
        lambda ids: table[ids], windows, reference_fn=lambda ids: table[ids] * 0.5, batch_size=3, show_progress=False
    )
    assert one.tokens == three.tokens == sum(len(w.input_ids) - w.first_scored for w in windows) == 289
    assert one.nll_sum == pytest.approx(three.nll_sum, rel=1e-12)
    assert one.kl_summary() == pytest.approx(three.kl_summary(), rel=1e-12)


def _direct(model_dir, reference_dir, config: EvalConfig) -> dict[str, float]:
    """The figures computed all at once: every window in one forward pass per model, every scored position's
    log-probabilities kept, then reduced (what evaluation did before it streamed)."""
    from quantkit.data.sources import load_documents
    from quantkit.data.tokens import bos_prefix, encode_documents, join_documents
    from quantkit.model.resolve import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    docs = load_documents(config.dataset)
    stream = join_documents(encode_documents(tokenizer, docs.texts, show_progress=False), tokenizer.eos_token_id)
    prefix = bos_prefix(tokenizer)
    windows = make_windows(stream, config.seq_len, config.seq_len - len(prefix), prefix, config.max_windows)
    ids = torch.tensor([w.input_ids for w in windows])
    with torch.inference_mode():
        logits = load_model(str(model_dir))(input_ids=ids).logits.float()
        reference = load_model(str(reference_dir))(input_ids=ids).logits.float()
    picked = [(row, w.first_scored) for row, w in enumerate(windows)]
    model_logits = torch.cat([logits[r, f - 1 : -1] for r, f in picked])
    ref_logits = torch.cat([reference[r, f - 1 : -1] for r, f in picked])
    targets = torch.cat([ids[r, f:] for r, f in picked])
    kl = token_kl(ref_logits, model_logits)
    return {
        "tokens": targets.numel(),
        "perplexity": float(token_nll(model_logits, targets).mean().exp()),
        "reference_perplexity": float(token_nll(ref_logits, targets).mean().exp()),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "top1_agreement": float((ref_logits.argmax(-1) == model_logits.argmax(-1)).double().mean()),
    }


def test_streamed_evaluation_equals_the_all_at_once_computation(tiny_model_dir, other_model_dir, text_corpus):
    config = EvalConfig(
        dataset=str(text_corpus), seq_len=32, max_windows=6, reference=str(other_model_dir), show_progress=False
    )
    result = evaluate(tiny_model_dir, config)
    direct = _direct(tiny_model_dir, other_model_dir, config)
    assert result.windows == 6 and result.tokens == direct["tokens"] == 6 * 31
    for key in ("perplexity", "reference_perplexity", "kl_mean", "kl_p99"):  # one forward vs six: float32 noise
        assert getattr(result, key) == pytest.approx(direct[key], rel=1e-5), key
    assert result.top1_agreement == pytest.approx(direct["top1_agreement"], abs=1 / result.tokens)
    assert result.kl_mean > 1e-3 and result.reference_perplexity != pytest.approx(result.perplexity, rel=1e-3)


def test_json_has_reference_perplexity_and_percent_change(
    tiny_model_dir, other_model_dir, text_corpus, tmp_path, capsys
):
    from helpers.cli import run_cli

    report = tmp_path / "eval.json"
    args = ["eval", str(tiny_model_dir), "--dataset", str(text_corpus), "--seq-len", "32", "--max-windows", "4"]
    code, out, err = run_cli([*args, "--reference", str(other_model_dir), "--json", str(report)], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    for key in ("perplexity", "tokens", "windows", "kl_mean", "kl_p99", "top1_agreement", "reference"):
        assert key in data  # the keys recipes, gates and scripts read stay
    ratio = data["perplexity"] / data["reference_perplexity"] - 1
    assert abs(data["perplexity_change_pct"] / 100 - ratio) < 1e-9
    assert data["windows"] == 4 and data["reference"] == str(other_model_dir)
    assert f"{data['perplexity_change_pct']:+.2f}%" in out and f"{data['reference_perplexity']:.3f}" in out

    code, out, err = run_cli([*args, "--json", str(report)], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["reference_perplexity"] is None and data["perplexity_change_pct"] is None


def test_all_windows_flag_scores_the_whole_text(tiny_model_dir, text_corpus, tmp_path, capsys):
    from helpers.cli import run_cli

    report = tmp_path / "eval.json"
    args = ["eval", str(tiny_model_dir), "--dataset", str(text_corpus), "--seq-len", "128", "--json", str(report)]
    code, _, err = run_cli([*args, "--all-windows"], capsys)
    assert code == 0, err
    every = json.loads(report.read_text())["windows"]
    assert every > DEFAULT_EVAL_WINDOWS  # the test text holds more than the default
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert json.loads(report.read_text())["windows"] == DEFAULT_EVAL_WINDOWS


def _result(**fields) -> EvalResult:
    base = {
        "model": "out/smollm2-135m-w4-gptq-g64-with-a-rather-long-directory-name-that-does-not-fit",
        "dataset": "shipped:austen_persuasion_eval.txt",
        "dataset_hash": "0" * 64,
        "seq_len": 512,
        "stride": 512,
        "windows": 40,
        "tokens": 20440,
        "perplexity": 13.4121,
        "seconds": 35.2,
    }
    return EvalResult(**(base | fields))


LABELS = (
    "figure",
    "value",
    "perplexity",
    "reference",
    "reference perplexity",
    "perplexity change",
    "KL mean (nats/token)",
    "KL p99",
    "top-1 agreement",
    "tokens scored",
    "windows",
    "seconds",
)


@pytest.mark.parametrize("width", [80, 60])
def test_table_keeps_every_word_at_80_columns(width):
    result = _result(
        reference="/models/a/deeply/nested/path/to/the/float/reference/smollm2-135m-instruct-original",
        reference_perplexity=12.9871,
        perplexity_change_pct=3.2724,
        kl_mean=0.034121,
        kl_p99=0.31211,
        top1_agreement=0.91342,
    )
    console = Console(width=width, file=io.StringIO(), record=True, emoji=False)
    console.print(eval_table(result))
    text = console.export_text()
    assert "…" not in text
    assert max(map(len, text.splitlines())) <= width
    lines = [line for line in text.splitlines() if line.strip()]
    for label in LABELS:
        assert any(label in line for line in lines), label  # each label whole, on one line
    for figure in ("13.412", "12.987", "+3.27%", "0.03412", "0.3121", "0.9134", "20,440", "40 x 512 tokens"):
        assert figure in text, figure
    folded = "".join(text.split()).replace("│", "").replace("┃", "")
    assert result.reference.replace("/", "") in folded.replace("/", "")  # folded onto lines, not cut


def test_table_without_a_reference_leaves_reference_rows_out():
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(eval_table(_result()))
    text = console.export_text()
    assert "perplexity" in text and "13.412" in text
    assert "reference" not in text and "KL" not in text
