"""How much of a figure is noise: standard errors over evaluation windows, and paired comparisons of two models
on the same windows.

A window is the sampling unit (tokens inside one are correlated, as llama.cpp's perplexity tool also accounts for
with its chunks): every per-token mean here is a ratio of per-window sums, ``sum(x_w) / sum(n_w)``, whose standard
error is the cluster (ratio-estimator) one, ``sqrt(n / (n - 1) * sum((x_w - mean * n_w)^2)) / sum(n_w)``. A paired
comparison takes each window's difference between two models first, which cancels what the windows share (a hard
passage is hard for both), so it resolves far smaller differences than two independent error bars.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from quantkit.eval.logit_metrics import RunningMetrics

Z_95 = 1.959963984540054  # the two-sided 95% normal quantile

BETTER, WORSE, SAME = "better", "worse", "indistinguishable"


def ratio_mean_se(sums: Sequence[float], counts: Sequence[int]) -> tuple[float, float]:
    """The per-token mean of per-window ``sums`` over ``counts`` tokens, and its standard error over windows
    (0 for a single window: no spread is measurable)."""
    total = float(sum(counts))
    mean = sum(sums) / total
    n = len(sums)
    if n < 2:
        return mean, 0.0
    spread = sum((x - mean * c) ** 2 for x, c in zip(sums, counts, strict=True))
    return mean, math.sqrt(n / (n - 1) * spread) / total


@dataclass(frozen=True, slots=True)
class PairedDifference:
    """Per-token mean of (A - B) over the same windows, its standard error, 95% interval and verdict for A (lower is
    better for NLL and KL)."""

    mean: float
    se: float
    windows: int

    @property
    def interval(self) -> tuple[float, float]:
        return self.mean - Z_95 * self.se, self.mean + Z_95 * self.se

    @property
    def verdict(self) -> str:
        low, high = self.interval
        return BETTER if high < 0 else WORSE if low > 0 else SAME

    def to_dict(self) -> dict:
        low, high = self.interval
        return {"mean": self.mean, "se": self.se, "ci95": [low, high], "windows": self.windows, "verdict": self.verdict}


def paired_difference(a: Sequence[float], b: Sequence[float], counts: Sequence[int]) -> PairedDifference:
    """A's per-window sums minus B's on the same windows (``counts`` tokens each)."""
    if len(a) != len(b) or len(a) != len(counts):
        raise ValueError("a paired comparison needs the same windows for both models")
    mean, se = ratio_mean_se([x - y for x, y in zip(a, b, strict=True)], counts)
    return PairedDifference(mean, se, len(counts))


def standard_errors(metrics: RunningMetrics) -> dict[str, float | None]:
    """The standard errors of an evaluation's figures over its windows (EvalResult's ``*_se`` fields): perplexity
    (``ppl * se(mean NLL)``, to first order), and against a reference the perplexity change in percentage points
    (paired with the reference's NLL on the same windows), KL mean and top-1 agreement."""
    windows = metrics.windows
    counts = [w.tokens for w in windows]
    out: dict[str, float | None] = {"perplexity_se": None, "perplexity_change_se": None}
    out |= {"kl_mean_se": None, "top1_se": None}
    if not windows:
        return out
    mean, se = ratio_mean_se([w.nll for w in windows], counts)
    out["perplexity_se"] = math.exp(mean) * se
    if metrics.reference_tokens:
        change = paired_difference([w.nll for w in windows], [w.reference_nll for w in windows], counts)
        out["perplexity_change_se"] = 100.0 * math.exp(change.mean) * change.se
        out["kl_mean_se"] = ratio_mean_se([w.kl for w in windows], counts)[1]
        out["top1_se"] = ratio_mean_se([float(w.top1) for w in windows], counts)[1]
    return out


def compare_metrics(other: str, a: RunningMetrics, b: RunningMetrics) -> dict:
    """A (the evaluated model) against B (``other``) on the same windows: B's perplexity, the paired NLL difference
    (and the perplexity ratio it implies, in percent), and with a reference the paired KL difference; each with its
    standard error, 95% interval and whether A is better, worse or indistinguishable."""
    counts = [w.tokens for w in a.windows]
    if counts != [w.tokens for w in b.windows]:
        raise ValueError("a paired comparison needs the same windows for both models")
    nll = paired_difference([w.nll for w in a.windows], [w.nll for w in b.windows], counts)
    low, high = nll.interval
    out = {
        "model": other,
        "perplexity": b.perplexity,
        "nll_difference": nll.to_dict(),
        "perplexity_ratio_pct": 100.0 * (math.exp(nll.mean) - 1.0),
        "perplexity_ratio_ci95_pct": [100.0 * (math.exp(low) - 1.0), 100.0 * (math.exp(high) - 1.0)],
        "verdict": nll.verdict,
    }
    if a.reference_tokens and b.reference_tokens:
        out["kl_difference"] = paired_difference([w.kl for w in a.windows], [w.kl for w in b.windows], counts).to_dict()
        out["kl_mean"] = b.kl_summary()[0]
    return out
