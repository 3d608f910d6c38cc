"""A recipe run's figures in the checkpoint's model card: the evaluation section quantize left empty gets the
metrics and the gates, so the card pushed with the checkpoint says how it measured."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from quantkit.atomic import write_text
from quantkit.format.coverage_table import markdown_table
from quantkit.format.files import MODEL_CARD
from quantkit.quantization.model_card import with_evaluation
from quantkit.recipes.report import RecipeReport
from quantkit.recipes.report_markdown import metric_rows
from quantkit.redaction import redact


def evaluation_lines(report: RecipeReport) -> list[str]:
    """The metrics table (as report.md shows it), what they were measured on, and each gate's verdict."""
    evaluation = report.config.get("evaluation") or {}
    reference = evaluation.get("reference")
    dataset = evaluation.get("dataset")
    against = f"`{_name(reference)}`" if reference else "the base model"
    text = f"`{_name(dataset)}`" if dataset else "quantkit's shipped held-out text"
    lines = [f"Measured by a quantkit recipe run against {against} on {text}:", ""]
    lines += markdown_table(["metric", "value"], [[str(a), str(b)] for a, b in metric_rows(report)])
    if report.gates:
        verdicts = [
            f"{g.name} {g.comparison} {g.threshold:g}: {g.value:.6g}, {'pass' if g.passed else 'FAIL'}"
            for g in report.gates
        ]
        lines += ["", "Gates: " + "; ".join(verdicts) + "."]
    return lines


def _name(value: str) -> str:
    """A dataset or model as the card may show it: a local path by its last part (the card leaves this machine)."""
    path = Path(value)
    return path.name if path.is_absolute() or value.startswith(".") or path.exists() else value


def update_model_card(report: RecipeReport, secrets: Mapping[str, str] | None = None) -> bool:
    """Write the run's figures into the evaluation section of the card in the report's checkpoint, secret-named
    substitutions redacted as in the report; False when the checkpoint has no card (an older quantkit's)."""
    card = Path(report.output) / MODEL_CARD
    if not card.is_file():
        return False
    lines = redact(evaluation_lines(report), secrets or {})
    write_text(card, with_evaluation(card.read_text(), lines))
    return True
