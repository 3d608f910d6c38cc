"""The quantization stages of a recipe run: the layout check before any work, the job config the recipe stands
for, the quantize stage (reused when the output holds this recipe's checkpoint) and the exports beside it."""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.quantization.config import QuantizeConfig
from quantkit.recipes.cache import checkpoint_hash, content_key
from quantkit.recipes.stages import RecipeRun


def check_layouts(run: RecipeRun, model_path: Path) -> None:
    """Before any work: every layer's scheme must be a layout engines load (unless the recipe's policy says
    otherwise). A mixed plan is checked per candidate when it is measured."""
    from quantkit.export.run import check_exports_of_model
    from quantkit.model.resolve import arch_for_dir
    from quantkit.model.source_weights import SourceWeights
    from quantkit.quantization.job import scheme_assignment

    check_exports_of_model(model_path, run.recipe.output.export_formats())
    q = run.recipe.quantization
    if q.mixed is not None:
        return
    config = quantize_config(run, None, None if q.plan is None else Path(q.plan))
    scheme_assignment(config, arch_for_dir(model_path), SourceWeights(model_path))


def quantize_config(run: RecipeRun, calib_path: Path | None, plan_path: Path | None) -> QuantizeConfig:
    """The recipe's quantization section as a job config (the output is replaced once the new one is done)."""
    from quantkit.mixed.plan_apply import planned_schemes, with_planned_outer_configs

    q = run.recipe.quantization
    solvers = q.solver_configs()
    if plan_path is not None:  # a whole-model plan's head and embedding schemes, which sized the checkpoint
        solvers = with_planned_outer_configs(plan_path, solvers)
    return QuantizeConfig(
        solvers=solvers,
        scheme=q.quant_scheme(),
        calibration_file=calib_path,
        ignore=list(q.ignore),
        layout_policy=q.layout_policy,
        batch_size=q.batch_size,
        compute_dtype=q.compute_dtype,
        export_formats=run.recipe.output.export_formats(),
        planned=None if plan_path is None else planned_schemes(plan_path, run.recipe.model),
        force=True,
        device=run.recipe.device,
        show_progress=run.show_progress,
    )


def quantize_stage(run: RecipeRun, model_path: Path, calib_path: Path, plan_path: Path | None, output: Path) -> None:
    """Quantize, unless ``output`` holds a checkpoint whose recorded fingerprints are this run's."""
    from quantkit.quantization.checkpoint_output import read_run_fingerprints
    from quantkit.quantization.pipeline import quantize_model

    with run.stage("quantize") as st:
        config = quantize_config(run, calib_path, plan_path)
        expected = expected_fingerprints(config, model_path, calib_path)
        st.key = content_key(**expected)
        found = read_run_fingerprints(output)
        st.cached = found == expected
        if not st.cached and _interrupted_run_of(output, expected):
            config.resume = True  # an earlier run of this recipe was interrupted: continue after its last block
        if not st.cached:
            if output.exists() and not run.recipe.output.force:
                differs = [k for k in expected if found and found.get(k) != expected[k]]
                why = f"its {', '.join(differs)} differ" if differs else "it is not a quantkit checkpoint"
                raise QuantkitError(
                    f"output directory '{output}' exists and does not hold this recipe's checkpoint ({why}); "
                    "set output.force: true (or --set output.force=true) to replace it"
                )
            result = quantize_model(run.recipe.model, config, output)
            # the peak of the whole process: with a kl/hybrid sensitivity stage before, that stage's peak counts
            measured = any(r.name == "sensitivity" and not r.cached for r in run.stages)
            label = "peak RSS MB (process, incl. sensitivity)" if measured else "quantize peak RSS MB"
            run.figures[label] = round(result.peak_rss_mb, 1)
        st.detail = str(output)
    run.hashes["checkpoint fingerprints"] = st.key
    run.hashes["checkpoint files"] = checkpoint_hash(output)
    run.figures["checkpoint MB"] = round(sum(f.stat().st_size for f in output.glob("*.safetensors")) / 1e6, 3)


def _interrupted_run_of(output: Path, expected: dict[str, str]) -> bool:
    """Whether ``output``'s work directory holds an interrupted quantization with these fingerprints."""
    from quantkit.quantization.workdir import STATE, partial_dir

    try:
        return json.loads((partial_dir(output) / STATE).read_text()).get("fingerprints") == expected
    except (OSError, ValueError, AttributeError):
        return False


def export_stage(run: RecipeRun, output: Path) -> None:
    """The exports ``output.formats`` asks for, beside the checkpoint; kept while the checkpoint is unchanged."""
    from quantkit.export.run import default_export_path, export_checkpoint

    quantized_again = any(r.name == "quantize" and not r.cached for r in run.stages)
    for fmt in run.recipe.output.export_formats():
        path = default_export_path(output, fmt)
        with run.stage(f"export {fmt}") as st:
            st.cached = path.exists() and not quantized_again
            if not st.cached:
                export_checkpoint(output, fmt, path, force=True)
            st.detail = str(path)
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        run.figures[f"{fmt} MB"] = round(sum(f.stat().st_size for f in files) / 1e6, 3)


def expected_fingerprints(config: QuantizeConfig, model_path: Path, calib_path: Path) -> dict[str, str]:
    """The fingerprints quantizing with ``config`` records (the pipeline's own functions)."""
    from quantkit.data.calibration import CalibrationSet
    from quantkit.model.resolve import arch_for_dir
    from quantkit.model.source_weights import SourceWeights
    from quantkit.quantization.job import run_fingerprints, scheme_assignment

    config.validate()
    weights = SourceWeights(model_path)
    assignment = scheme_assignment(config, arch_for_dir(model_path), weights)
    calibration = CalibrationSet.load(calib_path) if config.needs_calibration else None
    return run_fingerprints(config, assignment, weights.fingerprint(), calibration)
