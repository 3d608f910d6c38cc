"""Run a recipe: calibrate -> (sensitivity -> plan) -> quantize -> evaluate -> gates -> smoke, with a report (and the
figures written into the checkpoint's model card).

Each stage is in :mod:`quantkit.recipes.stages`; what is reused from the cache, and by which keys, is in
:mod:`quantkit.recipes.cache`; the report in :mod:`quantkit.recipes.report`.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from quantkit.format.coverage import audit_checkpoint
from quantkit.format.files import shard_files
from quantkit.quantization.output_lock import output_lock
from quantkit.recipes.card_evaluation import update_model_card
from quantkit.recipes.gguf_stage import gguf_stages
from quantkit.recipes.quantize_stages import check_layouts, export_stage, quantize_stage
from quantkit.recipes.report import RecipeReport, check_gates, environment, write_report
from quantkit.recipes.schema import Recipe, recipe_secrets, recipe_to_dict
from quantkit.recipes.stages import (
    RecipeRun,
    calibration_stage,
    evaluate_stages,
    mixed_stages,
    model_stage,
    preflight,
    smoke_stage,
)


def run_recipe(
    recipe: Recipe,
    *,
    recipe_path: Path | None = None,
    report_dir: Path | None = None,
    console: Console | None = None,
    show_progress: bool = True,
) -> RecipeReport:
    """Run every stage of ``recipe``; write report.json and report.md; return the report (gates decided)."""
    preflight(recipe)
    with output_lock(Path(recipe.output.directory)):  # one run per output: its checkpoint, exports and report
        return _run(recipe, recipe_path, report_dir, console, show_progress)


def _run(
    recipe: Recipe, recipe_path: Path | None, report_dir: Path | None, console: Console | None, show_progress: bool
) -> RecipeReport:
    run = RecipeRun(recipe, console, show_progress)
    output = Path(recipe.output.directory)
    report_dir = Path(report_dir) if report_dir is not None else output / "report"
    model_path, model_id = model_stage(run)
    check_layouts(run, model_path)
    calib_path = calibration_stage(run, model_id)
    plan_path = mixed_stages(run, model_id, model_path, calib_path) if recipe.quantization.mixed is not None else None
    if recipe.quantization.plan is not None:
        plan_path = Path(recipe.quantization.plan)
    quantize_stage(run, model_path, calib_path, plan_path, output)
    export_stage(run, output)
    gguf_stages(run, calib_path, output)
    quantized, baseline = evaluate_stages(run, model_id, output)
    audit = audit_checkpoint(output)
    run.figures["quantized fraction"] = round(audit.quantized_fraction, 6)
    size_mb = sum(f.stat().st_size for f in shard_files(output)) / 1e6
    run.figures["checkpoint MB"] = round(size_mb, 3)
    gates = check_gates(recipe.gates, quantized, baseline, audit.quantized_fraction, size_mb)
    smoke = smoke_stage(run, output)
    report = RecipeReport(
        recipe=str(recipe_path) if recipe_path else "",
        output=str(output),
        report_dir=str(report_dir),
        passed=all(g.passed for g in gates) and (smoke is None or bool(smoke.get("ok"))),
        stages=run.stages,
        gates=gates,
        figures=run.figures,
        hashes=run.hashes,
        environment=environment(),
        smoke=smoke,
        config=recipe_to_dict(recipe),
        artifacts=run.artifacts,
        coverage=audit.to_dict(),
    )
    write_report(report, report_dir, recipe_secrets(recipe))
    update_model_card(report, recipe_secrets(recipe))
    return report
