"""The stages of a recipe run, each timed, reported and, where its inputs are unchanged, taken from the cache:
model -> calibrate -> (sensitivity -> plan) -> quantize -> evaluate + baseline -> smoke."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from quantkit.atomic import write_json
from quantkit.errors import QuantkitError
from quantkit.progress import Interrupted
from quantkit.quantization.config import QuantizeConfig
from quantkit.recipes.cache import checkpoint_hash, content_key, model_identity, recipe_cache_root
from quantkit.recipes.report import StageRecord
from quantkit.recipes.schema import Recipe

RERUN_HINT = "rerun the recipe to continue (finished stages{} are reused)"  # quantize adds: " and blocks"


def section_fields(section: Any) -> dict[str, Any]:
    """A recipe section's fields as plain data."""
    return dict(section.model_dump())


class RecipeRun:
    """State shared by the stages of one run: the recipe, and what the stages have recorded so far."""

    def __init__(self, recipe: Recipe, console: Console | None, show_progress: bool) -> None:
        self.recipe = recipe
        self.console = console
        self.show_progress = show_progress
        self.stages: list[StageRecord] = []
        self.hashes: dict[str, str] = {}
        self.figures: dict[str, Any] = {}
        self.artifacts: dict[str, str] = {}  # files the report reads again: "measurement", "plan"
        self.root = recipe_cache_root()

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        record = StageRecord(name, 0.0, False)
        start = time.perf_counter()
        try:
            yield record
        except Interrupted as exc:  # quantize's "after block 11/30": a rerun resumes after that block
            raise exc.within(f"stage {name}", RERUN_HINT.format(" and blocks")) from exc
        except KeyboardInterrupt as exc:
            raise Interrupted(where=f"stage {name}", hint=RERUN_HINT.format("")) from exc
        record.seconds = time.perf_counter() - start
        self.stages.append(record)
        if self.console is not None:
            tag = " [cyan](cached)[/]" if record.cached else ""
            detail = f"  {record.detail}" if record.detail else ""
            self.console.print(f"[green]✓[/] {name:<12} {record.seconds:7.1f} s{tag}{detail}")


def preflight(recipe: Recipe) -> None:
    """Before the first stage: every stage's optional dependencies (extras) are installed and the recipe's device
    exists, so a missing one fails now, in one line naming it, not after the quantization."""
    from quantkit.device import resolve_device
    from quantkit.extras import require

    if recipe.smoke.enabled:
        require("serve", "the recipe's smoke stage (smoke.enabled: true)", otherwise="set smoke.enabled: false")
    resolve_device(recipe.device)  # `device: cuda` on a machine without one fails now


def model_stage(run: RecipeRun) -> tuple[Path, str]:
    from quantkit.model.resolve import resolve_model

    with run.stage("model") as st:
        path = resolve_model(run.recipe.model)
        identity = model_identity(path)
        st.key, st.detail = identity, str(path)
    run.hashes["model"] = identity
    return path, identity


def calibration_stage(run: RecipeRun, model_id: str) -> Path:
    from quantkit.data.calibration import CalibrationConfig, CalibrationSet, build_calibration
    from quantkit.data.sources import load_documents

    cal = run.recipe.calibration
    with run.stage("calibrate") as st:
        source_hash = load_documents(cal.dataset, text_column=cal.text_column).content_hash
        params = section_fields(cal)
        params.pop("dataset")
        st.key = content_key(model=model_id, source=source_hash, params=params)
        path = run.root / "calibration" / f"{st.key}.safetensors"
        st.cached = path.is_file()
        if st.cached:
            calibration = CalibrationSet.load(path)
        else:
            config = CalibrationConfig(dataset=cal.dataset, show_progress=run.show_progress, **params)
            calibration = build_calibration(run.recipe.model, config, output=path).calibration
        st.detail = f"{calibration.num_samples} x {calibration.seq_len}"
    run.hashes["calibration source"] = source_hash[:20]
    run.hashes["calibration"] = st.key
    run.figures["calibration windows"] = calibration.num_samples
    run.figures["calibration seq_len"] = calibration.seq_len
    return path


def mixed_stages(run: RecipeRun, model_id: str, calib_path: Path) -> Path:
    """Sensitivity (cached by its inputs), then the plan under the recipe's budget; returns the plan file."""
    from quantkit.mixed.measurement import load_measurement
    from quantkit.mixed.plan_file import save_plan
    from quantkit.mixed.planner import plan
    from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity, solver_options

    quantization = run.recipe.quantization
    mixed = quantization.mixed
    assert mixed is not None
    with run.stage("sensitivity") as st:
        solver = quantization.quant_scheme()
        gptq = solver_options(quantization.solver_configs())  # candidates are solved as quantize solves them
        st.key = content_key(
            model=model_id,
            calibration=run.hashes["calibration"],
            candidates=mixed.candidates,
            mode=mixed.mode,
            damp=gptq.damp,
            act_order=solver.act_order,
            mse_clip=solver.mse_clip,
        )
        path = run.root / "measurement" / f"{st.key}.json"
        st.cached = path.is_file()
        if st.cached:
            measurement = load_measurement(path)
        else:
            config = SensitivityConfig(
                candidates=list(mixed.candidates),
                mode=mixed.mode,
                gptq=gptq,
                act_order=solver.act_order,
                mse_clip=solver.mse_clip,
                calibration_file=calib_path,
                device=run.recipe.device,
                show_progress=run.show_progress,
            )
            measurement = measure_sensitivity(run.recipe.model, config, path)
        st.detail = f"{len(measurement.units)} units, mode {mixed.mode}"
    run.hashes["measurement"] = st.key
    with run.stage("plan") as st:
        pins = list(mixed.pins.items())
        chosen = plan(measurement, target_bits=mixed.target_bits, max_size_mb=mixed.max_size_mb, pins=pins)
        st.key = content_key(measurement=run.hashes["measurement"], budget=[mixed.target_bits, mixed.max_size_mb])
        plan_path = save_plan(chosen, run.root / "plans" / f"{st.key}-{content_key(pins=mixed.pins)}.yaml")
        st.detail = f"{chosen.bits_per_weight:.3f} bits/weight"
    run.artifacts |= {"measurement": str(path), "plan": str(plan_path)}
    run.figures["planned bits per weight"] = round(chosen.bits_per_weight, 4)
    run.figures["planned size MB"] = round(chosen.size_mb, 3)
    return plan_path


def smoke_stage(run: RecipeRun, output: Path) -> dict[str, Any] | None:
    smoke = run.recipe.smoke
    if not smoke.enabled:
        return None
    try:
        from quantkit.server.smoke import run_smoke
    except ImportError as exc:
        raise QuantkitError(
            f"smoke.enabled is true but the smoke test is unavailable ({exc}); set smoke.enabled: false"
        ) from exc
    with run.stage("smoke") as st:
        result = run_smoke(output, prompts=smoke.prompts, max_tokens=smoke.max_tokens)
        st.detail = f"{result.requests} requests, {'ok' if result.ok else 'FAILED'}"
    return result.to_dict()


def evaluate_stages(run: RecipeRun, model_id: str, output: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint against the reference, and the reference's own perplexity (both cached)."""
    from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
    from quantkit.eval.evaluate import EvalConfig
    from quantkit.model.resolve import resolve_model

    ev = run.recipe.evaluation
    reference = ev.reference or run.recipe.model
    ref_id = model_id if reference == run.recipe.model else model_identity(resolve_model(reference))
    dataset_hash = load_documents(ev.dataset or str(DEFAULT_EVALUATION)).content_hash
    params = {"seq_len": ev.seq_len, "windows": ev.windows, "dataset": dataset_hash}
    config = EvalConfig(
        dataset=ev.dataset,
        seq_len=ev.seq_len,
        max_windows=ev.windows,
        reference=reference,
        batch_size=ev.batch_size,
        device=run.recipe.device,
        show_progress=run.show_progress,
    )
    quant_key = content_key(checkpoint=run.hashes["checkpoint files"], reference=ref_id, **params)
    quantized = _cached_eval(run, "evaluate", quant_key, str(output), config)
    base_key = content_key(model=ref_id, reference=None, **params)
    baseline = _cached_eval(
        run, "baseline", base_key, reference, replace(config, reference=None), _baseline_from(quantized, reference)
    )
    run.hashes["evaluation text"] = dataset_hash[:20]
    run.hashes["reference"] = ref_id
    increase = (quantized["perplexity"] / baseline["perplexity"] - 1) * 100
    run.figures.update(
        {
            "perplexity": round(quantized["perplexity"], 4),
            "baseline perplexity": round(baseline["perplexity"], 4),
            "perplexity increase %": round(increase, 3),
            "kl mean": quantized["kl_mean"],
            "kl p99": quantized["kl_p99"],
            "top-1 agreement": quantized["top1_agreement"],
            "eval tokens": quantized["tokens"],
            "eval windows": quantized["windows"],
        }
    )
    return quantized, baseline


def _baseline_from(quantized: dict[str, Any], reference: str) -> dict[str, Any] | None:
    """The reference's own evaluation, when the checkpoint's evaluation already ran it over the same tokens."""
    if quantized.get("reference_perplexity") is None:
        return None
    compared = ("kl_mean", "kl_p99", "top1_agreement", "reference_perplexity", "perplexity_change_pct")
    return (
        quantized
        | {"model": reference, "reference": None, "perplexity": quantized["reference_perplexity"]}
        | {key: None for key in compared}
    )


def _cached_eval(
    run: RecipeRun, name: str, key: str, model: str, config: Any, derived: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An evaluation from the run's cache, else ``derived`` (figures another stage already measured), else run."""
    from quantkit.eval.evaluate import evaluate

    with run.stage(name) as st:
        st.key = key
        path = run.root / "eval" / f"{key}.json"
        st.cached = path.is_file()
        if st.cached:
            result = json.loads(path.read_text())
        else:
            result = derived if derived is not None else evaluate(model, config).to_dict()
            write_json(path, result)
        st.detail = f"ppl {result['perplexity']:.3f} over {result['windows']} windows"
    return result


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
    from quantkit.mixed.plan_apply import planned_schemes

    q = run.recipe.quantization
    return QuantizeConfig(
        solvers=q.solver_configs(),
        scheme=q.quant_scheme(),
        calibration_file=calib_path,
        ignore=list(q.ignore),
        layout_policy=q.layout_policy,
        batch_size=q.batch_size,
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
