"""The evaluation tables: one row per figure, so they fit an 80-column terminal (or a pipe) with nothing cut; with
--behaviour, a second table sets the candidate's reply figures beside the reference's."""

from __future__ import annotations

from rich.table import Table

from quantkit.eval.behaviour import AGREEMENT_TOKENS
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


def behaviour_table(behaviour: dict) -> Table:
    """Reply figures (``EvalResult.behaviour``): reference, candidate and their difference, ``±`` one standard
    error over prompts."""
    table = Table(
        title=f"Behaviour: greedy replies to {behaviour['prompts']} shipped chat prompts "
        f"(at most {behaviour['max_new_tokens']} new tokens)",
        title_justify="left",
    )
    for column in ("figure", "reference", "candidate", "difference"):
        table.add_column(column, justify="left" if column == "figure" else "right", overflow="fold")
    reference, candidate, difference = behaviour["reference"] or {}, behaviour["candidate"], behaviour["difference"]
    rows = [("end rate", "end_rate", ".3f"), ("repetition (4-grams)", "repetition", ".3f")]
    for label, key, spec in rows:
        table.add_row(
            label,
            _with_se(reference.get(key), reference.get(f"{key}_se"), spec),
            _with_se(candidate[key], candidate[f"{key}_se"], spec),
            _fmt(difference[key], "+" + spec),
        )
    table.add_row(
        "mean reply tokens",
        _fmt(reference.get("mean_reply_tokens"), ".1f"),
        _fmt(candidate["mean_reply_tokens"], ".1f"),
        _fmt(difference["mean_reply_tokens"], "+.1f"),
    )
    if behaviour["reasoning_tags"]:
        closer = behaviour["reasoning_tags"][1]
        table.add_row(
            "reasoning tag opened", _fmt(reference.get("tag_open_rate"), ".3f"), _fmt(candidate["tag_open_rate"], ".3f")
        )
        table.add_row(
            f"{closer} closed",
            _fmt(reference.get("tag_close_rate"), ".3f"),
            _fmt(candidate["tag_close_rate"], ".3f"),
            _fmt(difference["tag_close_rate"], "+.3f"),
        )
    agreement = _with_se(behaviour["first32_agreement"], behaviour["first32_agreement_se"], ".3f")
    table.add_row(f"first-{AGREEMENT_TOKENS}-token agreement", "-", agreement, "")
    table.add_row("seconds", "", f"{behaviour['seconds']:.1f}", "")
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
