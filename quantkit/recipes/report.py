"""A recipe run's report: each stage's time and cache hit, the gates against their thresholds, the figures,
content hashes and the environment; written as report.json and report.md, shown as rich tables."""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from quantkit.atomic import write_json, write_text
from quantkit.recipes.overrides import redact

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
GATES = ("max_ppl_increase_pct", "max_kl_mean", "min_top1_agreement")


@dataclass(slots=True)
class StageRecord:
    name: str
    seconds: float
    cached: bool
    key: str | None = None  # the content hash the stage was looked up by
    detail: str = ""


@dataclass(slots=True)
class GateResult:
    name: str
    value: float
    threshold: float
    comparison: str  # "<=" or ">="
    passed: bool
    margin: float  # how far inside (positive) or outside (negative) the threshold the value is


@dataclass(slots=True)
class RecipeReport:
    recipe: str
    output: str
    report_dir: str
    passed: bool
    stages: list[StageRecord] = field(default_factory=list)
    gates: list[GateResult] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    hashes: dict[str, str] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    smoke: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def failures(self) -> list[str]:
        """One line per failed gate (and the smoke test), with the measured value and the miss."""
        lines = [
            f"{g.name}: measured {g.value:.6g}, threshold {g.comparison} {g.threshold:g}, missed by {-g.margin:.6g}"
            for g in self.gates
            if not g.passed
        ]
        if self.smoke is not None and not self.smoke.get("ok", False):
            lines.append(f"smoke: {'; '.join(self.smoke.get('failures') or ['failed'])}")
        return lines


def check_gates(gates: Any, quantized: dict[str, Any], baseline: dict[str, Any]) -> list[GateResult]:
    """Each gate the recipe sets (``gates``: its gates section), measured against its threshold."""
    measured = {
        "max_ppl_increase_pct": (quantized["perplexity"] / baseline["perplexity"] - 1) * 100,
        "max_kl_mean": quantized["kl_mean"],
        "min_top1_agreement": quantized["top1_agreement"],
    }
    results = []
    for name in GATES:
        threshold = getattr(gates, name)
        if threshold is None:
            continue
        value = float(measured[name])
        is_max = name.startswith("max_")
        margin = threshold - value if is_max else value - threshold
        results.append(GateResult(name, value, float(threshold), "<=" if is_max else ">=", margin >= 0, margin))
    return results


def environment() -> dict[str, Any]:
    import torch
    import transformers

    from quantkit import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quantkit": __version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "argv": " ".join(sys.argv),
    }


def write_report(report: RecipeReport, directory: Path, secrets: dict[str, str] | None = None) -> None:
    """report.json and report.md, with the values of secret-named ``${VAR}`` substitutions redacted."""
    secrets = secrets or {}
    write_json(directory / REPORT_JSON, redact(report.to_dict(), secrets))
    write_text(directory / REPORT_MD, redact(render_markdown(report), secrets))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def render_markdown(report: RecipeReport) -> str:
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [f"# Recipe report: {report.recipe or report.output}", "", f"**{verdict}** - checkpoint `{report.output}`"]
    lines += ["", "## Gates", "", "| gate | measured | threshold | margin | verdict |", "|---|---|---|---|---|"]
    lines += [
        f"| {g.name} | {g.value:.6g} | {g.comparison} {g.threshold:g} | {g.margin:+.6g} | "
        f"{'pass' if g.passed else 'FAIL'} |"
        for g in report.gates
    ]
    if not report.gates:
        lines.append("| (none) | | | | |")
    if report.smoke is not None:
        lines += ["", f"Smoke test: {'ok' if report.smoke.get('ok') else 'FAILED'} ({_fmt(report.smoke)})"]
    lines += ["", "## Figures", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in report.figures.items()]
    lines += ["", "## Stages", "", "| stage | seconds | cached | key |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.seconds:.2f} | {'yes' if s.cached else 'no'} | {s.key or ''} |" for s in report.stages]
    lines += ["", "## Content hashes", "", "| what | hash |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in report.hashes.items()]
    lines += ["", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in report.environment.items()]
    lines += ["", "## Recipe (resolved)", "", "```json", json.dumps(report.config, indent=2), "```", ""]
    return "\n".join(lines)


def render_tables(report: RecipeReport) -> list[Table]:
    stages = Table(title="Stages")
    for column in ("stage", "seconds", "cached"):
        stages.add_column(column, justify="right" if column == "seconds" else "left")
    for s in report.stages:
        stages.add_row(s.name, f"{s.seconds:.1f}", "yes" if s.cached else "no")
    figures = Table(title="Figures")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for key, value in report.figures.items():
        figures.add_row(key, _fmt(value))
    gates = Table(title="Gates")
    for column in ("gate", "measured", "threshold", "margin", "verdict"):
        gates.add_column(column, justify="left" if column in ("gate", "verdict") else "right")
    for g in report.gates:
        verdict = "[green]pass[/]" if g.passed else "[bold red]FAIL[/]"
        gates.add_row(g.name, f"{g.value:.6g}", f"{g.comparison} {g.threshold:g}", f"{g.margin:+.6g}", verdict)
    return [stages, figures, gates]
