"""Standard errors over windows and paired comparisons (quantkit/eval/noise.py): the formulas on constructed
windows, and `eval --compare` on tiny models."""

from __future__ import annotations

import math

import pytest

from quantkit.eval.evaluate import EvalConfig, evaluate
from quantkit.eval.noise import BETTER, SAME, WORSE, paired_difference, ratio_mean_se


def test_the_ratio_mean_and_its_cluster_standard_error():
    sums, counts = [10.0, 14.0, 9.0, 15.0], [5, 5, 5, 5]  # per-token means 2.0, 2.8, 1.8, 3.0
    mean, se = ratio_mean_se(sums, counts)
    assert mean == pytest.approx(48 / 20)
    means = [s / c for s, c in zip(sums, counts, strict=True)]
    spread = sum((m - mean) ** 2 for m in means) / (len(means) - 1)  # equal windows: the plain standard error
    assert se == pytest.approx(math.sqrt(spread / len(means)))
    assert ratio_mean_se([7.0], [3]) == (pytest.approx(7 / 3), 0.0)


def test_pairing_resolves_a_difference_two_error_bars_cannot():
    counts = [100] * 6
    hard_and_easy = [300.0, 100.0, 250.0, 120.0, 280.0, 90.0]  # windows differ a lot in difficulty
    a = [x - 2.0 for x in hard_and_easy]  # A is a little better on every window
    single_se = ratio_mean_se(a, counts)[1]
    paired = paired_difference(a, hard_and_easy, counts)
    assert paired.mean == pytest.approx(-0.02) and paired.se == pytest.approx(0.0, abs=1e-12)
    assert single_se > 0.1 and paired.verdict == BETTER
    noisy = paired_difference([1.0, 3.0, 2.0], [2.0, 2.0, 2.0], [10, 10, 10])
    assert noisy.verdict == SAME and noisy.interval[0] < 0 < noisy.interval[1]
    assert paired_difference([5.0, 6.0], [1.0, 1.5], [10, 10]).verdict == WORSE
    with pytest.raises(ValueError, match="same windows"):
        paired_difference([1.0], [1.0, 2.0], [1])


def test_eval_reports_standard_errors_and_compares_two_models(tiny_model_dir, text_corpus, tmp_path):
    from helpers.tiny import save_tiny_model

    other = save_tiny_model(tmp_path / "other", seed=5)
    config = EvalConfig(dataset=str(text_corpus), seq_len=32, max_windows=6, reference=str(other), show_progress=False)
    alone = evaluate(tiny_model_dir, config)
    assert alone.perplexity_se > 0 and alone.kl_mean_se > 0 and alone.top1_se > 0
    assert alone.perplexity_change_se > 0 and alone.comparison is None
    config.compare = str(tiny_model_dir)  # against itself: a zero difference, indistinguishable
    itself = evaluate(tiny_model_dir, config).comparison
    assert itself["nll_difference"]["mean"] == pytest.approx(0.0, abs=1e-9) and itself["verdict"] == SAME
    config.compare = str(other)  # against the reference model itself: A's KL is larger on every window
    versus = evaluate(tiny_model_dir, config).comparison
    assert versus["kl_mean"] == pytest.approx(0.0, abs=1e-6) and versus["kl_difference"]["verdict"] == WORSE
    assert versus["perplexity"] == pytest.approx(alone.reference_perplexity)


def test_the_table_shows_errors_and_the_verdict():
    from rich.console import Console

    from quantkit.eval.evaluate import EvalResult
    from quantkit.eval.report import eval_table

    result = EvalResult("a", "text", "h", 512, 512, 16, 8176, 44.9, 1.0, reference="r", reference_perplexity=44.0)
    result.perplexity_se, result.perplexity_change_pct, result.perplexity_change_se = 1.86, 1.98, 0.23
    result.comparison = {
        "model": "b",
        "perplexity": 45.2,
        "perplexity_ratio_pct": -0.53,
        "perplexity_ratio_ci95_pct": [-1.25, 0.2],
        "verdict": SAME,
    }
    console = Console(width=100, record=True)
    console.print(eval_table(result))
    text = console.export_text()
    for part in ("44.900 ± 1.860", "+1.98% ± 0.23%", "-0.53% (95% CI -1.25% .. +0.20%)", "indistinguishable from b"):
        assert part in text, part
