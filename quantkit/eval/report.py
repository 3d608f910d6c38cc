"""The evaluation table: one row per figure, so it fits an 80-column terminal (or a pipe) with nothing cut."""

from __future__ import annotations

from rich.table import Table

from quantkit.eval.evaluate import EvalResult


def eval_table(result: EvalResult) -> Table:
    """Figures of ``result`` as rows; long values (paths, names) fold onto further lines instead of being cut."""
    table = Table(title=f"Evaluation of {result.model}", title_justify="left")
    table.add_column("figure", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")
    table.add_row("perplexity", f"{result.perplexity:.3f}")
    if result.reference is not None:
        table.add_row("reference", result.reference)
        table.add_row("reference perplexity", _fmt(result.reference_perplexity, ".3f"))
        change = result.perplexity_change_pct
        table.add_row("perplexity change", "-" if change is None else f"{change:+.2f}%")
        table.add_row("KL mean (nats/token)", _fmt(result.kl_mean, ".5f"))
        table.add_row("KL p99", _fmt(result.kl_p99, ".4f"))
        table.add_row("top-1 agreement", _fmt(result.top1_agreement, ".4f"))
    table.add_row("tokens scored", f"{result.tokens:,}")
    table.add_row("windows", f"{result.windows} x {result.seq_len} tokens")
    table.add_row("text", result.dataset)
    table.add_row("seconds", f"{result.seconds:.1f}")
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
