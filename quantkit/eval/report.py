"""The evaluation table: one row per figure, so it fits an 80-column terminal (or a pipe) with nothing cut."""

from __future__ import annotations

from rich.table import Table

from quantkit.eval.evaluate import EvalResult
from quantkit.eval.noise import SAME


def eval_table(result: EvalResult) -> Table:
    """Figures of ``result`` as rows; long values (paths, names) fold onto further lines instead of being cut."""
    table = Table(title=f"Evaluation of {result.model}", title_justify="left")
    table.add_column("figure", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")
    table.add_row("perplexity", _with_se(result.perplexity, result.perplexity_se, ".3f"))
    if result.reference is not None:
        table.add_row("reference", result.reference)
        table.add_row("reference perplexity", _fmt(result.reference_perplexity, ".3f"))
        change = result.perplexity_change_pct
        table.add_row("perplexity change", _with_se(change, result.perplexity_change_se, "+.2f", "%"))
        table.add_row("KL mean (nats/token)", _with_se(result.kl_mean, result.kl_mean_se, ".5f"))
        table.add_row("KL p99", _fmt(result.kl_p99, ".4f"))
        table.add_row("top-1 agreement", _with_se(result.top1_agreement, result.top1_se, ".4f"))
    if result.comparison is not None:
        _comparison_rows(table, result.comparison)
    table.add_row("tokens scored", f"{result.tokens:,}")
    table.add_row("windows", f"{result.windows} x {result.seq_len} tokens")
    table.add_row("text", result.dataset)
    table.add_row("seconds", f"{result.seconds:.1f}")
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _with_se(value: float | None, se: float | None, spec: str, unit: str = "") -> str:
    """``value ± se`` (one standard error over windows), as llama.cpp's perplexity tool prints it."""
    if value is None:
        return "-"
    text = f"{format(value, spec)}{unit}"
    return text if se is None else f"{text} ± {format(se, spec.lstrip('+'))}{unit}"


def _comparison_rows(table: Table, comparison: dict) -> None:
    """The paired comparison with ``--compare``: the other model's figures and the verdict for this one."""
    table.add_row("compared with", comparison["model"])
    table.add_row("its perplexity", f"{comparison['perplexity']:.3f}")
    low, high = comparison["perplexity_ratio_ci95_pct"]
    ratio = comparison["perplexity_ratio_pct"]
    table.add_row("perplexity vs it (paired)", f"{ratio:+.2f}% (95% CI {low:+.2f}% .. {high:+.2f}%)")
    if "kl_difference" in comparison:
        kl = comparison["kl_difference"]
        table.add_row("its KL mean", f"{comparison['kl_mean']:.5f}")
        table.add_row("KL vs it (paired)", f"{kl['mean']:+.5f} ± {kl['se']:.5f} ({kl['verdict']})")
    relation = "from" if comparison["verdict"] == SAME else "than"
    table.add_row("verdict (perplexity)", f"{comparison['verdict']} {relation} {comparison['model']}")
