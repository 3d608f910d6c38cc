"""A recipe run's report: a summary of the run (model, method, schemes, size, bits per weight, time), the coverage
audit, the metrics, the gates against their thresholds, plots of the per-layer measurement and the plan's frontier,
each stage's time and cache hit, the figures, content hashes and the environment; written as report.json and
report.md (GitHub Markdown, rendered by :mod:`quantkit.recipes.report_markdown`, PNG plots beside it; without
matplotlib the report says they were skipped), shown as rich tables."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from quantkit.atomic import write_json, write_text
from quantkit.errors import QuantkitError
from quantkit.recipes.report_markdown import fmt_value, render_markdown
from quantkit.recipes.schema import BEHAVIOUR_GATES
from quantkit.redaction import redact, redact_argv

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PER_LAYER_PNG = "per_layer.png"
FRONTIER_PNG = "frontier.png"
GATES = (
    "max_ppl_increase_pct",
    "max_kl_mean",
    "min_top1_agreement",
    "min_quantized_fraction",
    "max_checkpoint_mb",
    *BEHAVIOUR_GATES,
)


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
    artifacts: dict[str, str] = field(default_factory=dict)  # files the run made: "measurement", "plan" (paths)
    checkpoint: dict[str, Any] = field(default_factory=dict)  # bits per weight, sizes, layers per scheme (inspect)
    coverage: dict[str, Any] = field(default_factory=dict)  # every weight, asked and written (format.coverage)
    plots: dict[str, str] = field(default_factory=dict)  # title -> PNG file name beside report.md
    plots_note: str = ""  # why there are no plots (none measured, matplotlib missing)

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


def check_gates(
    gates: Any,
    quantized: dict[str, Any],
    baseline: dict[str, Any],
    quantized_fraction: float,
    size_mb: float | None = None,
) -> list[GateResult]:
    """Each gate the recipe sets (``gates``: its gates section), measured against its threshold; the evaluations
    give the quality and behaviour gates, the checkpoint's coverage audit its ``quantized_fraction``, its files
    their ``size_mb``. A gate on a figure that does not apply (a tag close rate where the template has no
    reasoning tags) is not checked."""
    measured = {
        "max_ppl_increase_pct": (quantized["perplexity"] / baseline["perplexity"] - 1) * 100,
        "max_kl_mean": quantized["kl_mean"],
        "min_top1_agreement": quantized["top1_agreement"],
        "min_quantized_fraction": quantized_fraction,
        "max_checkpoint_mb": size_mb,
    } | behaviour_measures(quantized.get("behaviour"))
    results = []
    for name in GATES:
        threshold = getattr(gates, name)
        if threshold is None or measured.get(name) is None:
            continue
        value = float(measured[name])
        is_max = name.startswith("max_")
        margin = threshold - value if is_max else value - threshold
        results.append(GateResult(name, value, float(threshold), "<=" if is_max else ">=", margin >= 0, margin))
    return results


def behaviour_measures(behaviour: dict[str, Any] | None) -> dict[str, float | None]:
    """The behaviour gates' figures from an evaluation's ``behaviour`` (quantkit.eval.behaviour), {} without one."""
    if behaviour is None:
        return {}
    return {
        "min_end_rate": behaviour["candidate"]["end_rate"],
        "max_repetition_increase": behaviour["difference"]["repetition"],
        "min_first32_agreement": behaviour["first32_agreement"],
        "min_tag_close_rate": behaviour["candidate"]["tag_close_rate"],  # None: no reasoning tags
    }


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
        "argv": " ".join(redact_argv(sys.argv)),
    }


def write_report(report: RecipeReport, directory: Path, secrets: dict[str, str] | None = None) -> None:
    """report.json and report.md (with its plots beside it), with the values of secret-named ``${VAR}``
    substitutions redacted. Fills the report's checkpoint summary and plots first (see :func:`complete_report`)."""
    secrets = secrets or {}
    complete_report(report, Path(directory))
    write_json(directory / REPORT_JSON, redact(report.to_dict(), secrets))
    write_text(directory / REPORT_MD, redact(render_markdown(report), secrets))


# --------------------------------------------------------------------------------------------------
# What the report adds to the run's own records: the checkpoint's sizes, and plots
# --------------------------------------------------------------------------------------------------


def complete_report(report: RecipeReport, directory: Path) -> None:
    """The checkpoint summary and its coverage audit (read from its headers, as ``quantkit inspect``) and the plots
    of the run's per-layer measurement, drawn into ``directory``; without matplotlib, ``plots_note`` says they were
    skipped."""
    if not report.checkpoint:
        report.checkpoint = checkpoint_summary(Path(report.output))
    if not report.coverage:
        report.coverage = coverage_of(Path(report.output))
    if not report.plots and not report.plots_note:
        report.plots, report.plots_note = draw_plots(report, Path(directory))


def checkpoint_summary(path: Path) -> dict[str, Any]:
    """Bits per weight, sizes and the layers per scheme of the checkpoint in ``path`` ({} when there is none)."""
    from quantkit.format.inspect import inspect_checkpoint

    if not (path / "config.json").is_file():
        return {}
    try:
        found = inspect_checkpoint(path)
    except (QuantkitError, OSError):
        return {}
    return {
        "bits_per_weight": found.avg_bits_per_weight,
        "model_bits_per_weight": found.model_bits_per_weight,
        "bytes": found.checkpoint_bytes,
        "dense_bf16_bytes": found.dense_bf16_bytes,
        "quantized_params": found.quantized_params,
        "total_params": found.total_params,
        "groups": [asdict(g) for g in found.groups],
    }


def coverage_of(path: Path) -> dict[str, Any]:
    """The coverage audit of the checkpoint in ``path`` as data ({} when there is none)."""
    from quantkit.format.coverage import audit_checkpoint

    if not (path / "config.json").is_file():
        return {}
    try:
        return audit_checkpoint(path).to_dict()
    except (QuantkitError, OSError, ValueError):
        return {}


def draw_plots(report: RecipeReport, directory: Path) -> tuple[dict[str, str], str]:
    """(title -> PNG file name in ``directory``, note): the per-layer errors and the plan's frontier with the
    uniform schemes, when the run measured per-layer sensitivity; else no plots and a note saying why."""
    measurement_path = report.artifacts.get("measurement")
    if not measurement_path:
        return {}, "no per-layer plots: this run measured no per-layer sensitivity (quantization.mixed does)"
    from quantkit.mixed.plot import PLOT_EXTRA, plotting_unavailable

    missing = plotting_unavailable()
    if missing is not None:
        return {}, f"plots skipped: {missing} (the optional '{PLOT_EXTRA}' extra)"
    from quantkit.mixed.measurement import load_measurement
    from quantkit.mixed.plot import plot_frontier, plot_unit_errors

    try:
        measurement = load_measurement(Path(measurement_path))
        chosen = _replan(measurement, report.artifacts.get("plan"))
    except (QuantkitError, OSError) as exc:
        return {}, f"plots skipped: the run's measurement or plan could not be read again ({exc})"
    directory.mkdir(parents=True, exist_ok=True)
    error = "KL" if measurement.mode in ("kl", "hybrid") else "proxy error"
    plots = {
        f"{error} per layer ({measurement.mode})": plot_unit_errors(measurement, directory / PER_LAYER_PNG, chosen)
    }
    if chosen is not None:
        plots["Size/error frontier, uniform schemes marked"] = plot_frontier(
            measurement, chosen, directory / FRONTIER_PNG
        )
    return {title: path.name for title, path in plots.items()}, ""


def _replan(measurement: Any, plan_path: str | None) -> Any:
    """The run's plan, made again from the measurement under the budget and pins its plan file records."""
    if not plan_path:
        return None
    from quantkit.mixed.plan_file import load_plan
    from quantkit.mixed.planner import plan

    budget = load_plan(Path(plan_path)).budget
    pins = [(p["pattern"], p["scheme"]) for p in budget.get("pins") or []]
    return plan(measurement, target_bits=budget.get("target_bits"), max_size_mb=budget.get("max_size_mb"), pins=pins)


# --------------------------------------------------------------------------------------------------
# The terminal's tables (report.md: quantkit.recipes.report_markdown)
# --------------------------------------------------------------------------------------------------


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
        figures.add_row(key, fmt_value(value))
    gates = Table(title="Gates")
    for column in ("gate", "measured", "threshold", "margin", "verdict"):
        gates.add_column(column, justify="left" if column in ("gate", "verdict") else "right")
    for g in report.gates:
        verdict = "[green]pass[/]" if g.passed else "[bold red]FAIL[/]"
        gates.add_row(g.name, f"{g.value:.6g}", f"{g.comparison} {g.threshold:g}", f"{g.margin:+.6g}", verdict)
    return [stages, figures, gates]
