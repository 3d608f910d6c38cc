"""A recipe run's report as GitHub-flavoured Markdown: the summary, coverage, metrics, gates and smoke test as tables,
relative links to the plots beside report.md, the stages, figures, content hashes and environment, and the resolved
recipe in a collapsed block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from quantkit.format.coverage import CoverageAudit
from quantkit.format.coverage_table import coverage_markdown
from quantkit.format.sizes import format_mb, mb_number

if TYPE_CHECKING:
    from quantkit.recipes.report import RecipeReport


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def _cell(value: Any) -> str:
    """A table cell: pipes escaped, on one line."""
    return fmt_value(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]], align: str = "") -> list[str]:
    """A Markdown table; ``align`` has one letter per column, l or r (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return [
        "| " + " | ".join(header) + " |",
        rule,
        *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows),
    ]


def _method(report: RecipeReport) -> str:
    quantization = report.config.get("quantization") or {}
    method = str(quantization.get("method") or "-")
    rotate = quantization.get("rotate")
    return f"{method}, {rotate} rotation" if rotate and rotate != "none" else method


def _schemes(report: RecipeReport) -> str:
    groups = report.checkpoint.get("groups") or []
    if len(groups) == 1:
        return f"{groups[0]['scheme']} ({groups[0]['layers']} layers)"
    if groups:
        mixed = (report.config.get("quantization") or {}).get("mixed") or {}
        budget = f"target {mixed['target_bits']:g} bits/w" if mixed.get("target_bits") else "mixed plan"
        return f"mixed ({budget}): {len(groups)} schemes, layers per scheme below"
    scheme = (report.config.get("quantization") or {}).get("scheme") or {}
    return ", ".join(f"{k} {v}" for k, v in scheme.items()) or "-"


def _summary_rows(report: RecipeReport) -> list[list[Any]]:
    ckpt = report.checkpoint
    rows: list[list[Any]] = [
        ["model", f"`{report.config.get('model', '-')}`"],
        ["method", _method(report)],
        ["scheme", _schemes(report)],
    ]
    if ckpt:
        ratio = ckpt["dense_bf16_bytes"] / ckpt["bytes"] if ckpt["bytes"] else float("nan")
        rows.append(["size", f"{format_mb(ckpt['bytes'])} (bf16 {format_mb(ckpt['dense_bf16_bytes'])}, x{ratio:.2f})"])
        rows.append(
            [
                "bits per weight",
                f"{ckpt['bits_per_weight']:.3f} (quantized Linears); {ckpt['model_bits_per_weight']:.3f} (whole model)",
            ]
        )
    elif "checkpoint MB" in report.figures:
        rows.append(["size", f"{report.figures['checkpoint MB']} MB"])
    cached = [s.name for s in report.stages if s.cached]
    seconds = sum(s.seconds for s in report.stages)
    rows.append(["time", f"{seconds:.1f} s" + (f" (cached: {', '.join(cached)})" if cached else "")])
    rows.append(["checkpoint", f"`{report.output}`"])
    return rows


METRICS = (  # (label, figure key, format)
    ("perplexity", "perplexity", "{:.4f}"),
    ("reference perplexity", "baseline perplexity", "{:.4f}"),
    ("perplexity increase", "perplexity increase %", "{:+.2f}%"),
    ("KL mean", "kl mean", "{:.4g}"),
    ("KL p99", "kl p99", "{:.4g}"),
    ("top-1 agreement", "top-1 agreement", "{:.4f}"),
    ("end rate (replies)", "end rate", "{:.3f}"),
    ("reference end rate", "reference end rate", "{:.3f}"),
    ("repetition (4-grams)", "repetition", "{:.3f}"),
    ("reference repetition", "reference repetition", "{:.3f}"),
    ("first-32 agreement", "first-32 agreement", "{:.3f}"),
    ("tag close rate", "tag close rate", "{:.3f}"),
    ("reference tag close rate", "reference tag close rate", "{:.3f}"),
)


def metric_rows(report: RecipeReport) -> list[list[Any]]:
    rows = [[label, fmt.format(report.figures[key])] for label, key, fmt in METRICS if key in report.figures]
    if "eval windows" in report.figures:
        tokens = report.figures.get("eval tokens")
        rows.append(
            ["evaluated on", f"{report.figures['eval windows']} windows" + (f", {tokens:,} tokens" if tokens else "")]
        )
    return rows


def render_markdown(report: RecipeReport) -> str:
    """The report as Markdown that renders on GitHub: summary, metrics, gates, plots, then the details."""
    failed = [g.name for g in report.gates if not g.passed]
    verdict = f"**{'PASSED' if report.passed else 'FAILED'}**"
    if report.gates:
        verdict += ": " + (f"failed {', '.join(failed)}" if failed else f"all {len(report.gates)} gates passed")
    lines = [f"# Recipe report: {report.recipe or report.output}", "", verdict, "", "## Summary", ""]
    lines += _table(["run", ""], _summary_rows(report), "ll")
    groups = report.checkpoint.get("groups") or []
    if len(groups) > 1:
        rows = [
            [g["scheme"], g["layers"], f"{g['params']:,}", mb_number(g["bytes"]), f"{g['bits_per_weight']:.3f}"]
            for g in groups
        ]
        lines += ["", "Layers per scheme (MB: packed weights, scales and zero points):", ""]
        lines += _table(["scheme", "layers", "params", "MB", "bits/w"], rows)
    if report.coverage:
        lines += ["", "## Coverage", "", *coverage_markdown(CoverageAudit.from_dict(report.coverage))]
    lines += ["", "## Metrics", ""]
    metrics = metric_rows(report)
    lines += _table(["metric", "value"], metrics) if metrics else ["No evaluation figures."]
    lines += ["", "## Gates", ""]
    gate_rows = [
        [
            g.name,
            f"{g.comparison} {g.threshold:g}",
            f"{g.value:.6g}",
            f"{g.margin:+.6g}",
            "PASS" if g.passed else "FAIL",
        ]
        for g in report.gates
    ]
    lines += (
        _table(["gate", "threshold", "value", "margin", "result"], gate_rows, "lrrrl")
        if gate_rows
        else ["No gates set."]
    )
    if report.smoke is not None:
        smoke = report.smoke
        failures = "; ".join(smoke.get("failures") or []) or "-"
        lines += ["", "## Smoke test", ""]
        lines += _table(
            ["result", "requests", "seconds", "failures"],
            [["ok" if smoke.get("ok") else "FAILED", smoke.get("requests"), smoke.get("seconds"), failures]],
            "lrrl",
        )
    lines += ["", "## Plots", ""]
    for title, name in report.plots.items():
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    if report.plots_note:
        lines += [report.plots_note[0].upper() + report.plots_note[1:] + ".", ""]
    lines += ["## Stages", ""]
    lines += _table(
        ["stage", "seconds", "cached", "detail", "key"],
        [
            [s.name, f"{s.seconds:.2f}", "yes" if s.cached else "no", s.detail, f"`{s.key}`" if s.key else ""]
            for s in report.stages
        ],
        "lrlll",
    )
    shown = {key for _, key, _ in METRICS} | {"eval windows", "eval tokens"}
    shown |= {"checkpoint MB"} if report.checkpoint else set()  # the summary's size
    other = [[k, v] for k, v in report.figures.items() if k not in shown]
    if other:
        lines += ["", "## Other figures", "", *_table(["figure", "value"], other)]
    lines += [
        "",
        "## Content hashes",
        "",
        *_table(["what", "hash"], [[k, f"`{v}`"] for k, v in report.hashes.items()], "ll"),
    ]
    env = [[k, f"`{v}`" if k == "argv" else v] for k, v in report.environment.items()]
    lines += ["", "## Environment", "", *_table(["what", "value"], env, "ll")]
    recipe = yaml.safe_dump(report.config, sort_keys=False, default_flow_style=False, width=1000).rstrip()
    lines += ["", "<details><summary>Recipe (resolved)</summary>", "", "```yaml", recipe, "```", "", "</details>", ""]
    return "\n".join(lines)
