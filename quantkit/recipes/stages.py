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
from quantkit.recipes.cache import content_key, files_hash, model_identity, recipe_cache_root
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


def mixed_stages(run: RecipeRun, model_id: str, model_path: Path, calib_path: Path) -> Path:
    """Sensitivity (cached by its inputs), then the plan under the recipe's budget (the whole checkpoint's, head and
    embedding included, with ``whole_model``); returns the plan file."""
    from quantkit.mixed.measurement import load_measurement
    from quantkit.mixed.plan_file import save_plan
    from quantkit.mixed.planner import plan
    from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity, solver_options
    from quantkit.mixed.whole_plan import whole_model_plan
    from quantkit.quantization.methods.composition import JobSteps

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
            **({"outer": mixed.outer_candidates} if mixed.measures_outer else {}),
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
                outer=mixed.measures_outer,
                outer_candidates=list(mixed.outer_candidates),
            )
            measurement = measure_sensitivity(run.recipe.model, config, path)
        st.detail = f"{len(measurement.units)} units, mode {mixed.mode}"
    run.hashes["measurement"] = st.key
    with run.stage("plan") as st:
        pins = list(mixed.pins.items())
        budget: list[Any] = [mixed.target_bits, mixed.max_size_mb]
        if mixed.whole_model:
            assert mixed.max_size_mb is not None, "the schema asks a whole-model budget for max_size_mb"
            untied = JobSteps(quantization.solver_configs()).any_cap("unties_head")  # a rotation unties the head
            chosen = whole_model_plan(
                measurement, model_path, mixed.max_size_mb, head=mixed.head, embedding=mixed.embedding,
                untied_head=untied, pins=pins,
            )  # fmt: skip
            budget += ["whole model", mixed.head, mixed.embedding, untied]
        else:
            chosen = plan(measurement, target_bits=mixed.target_bits, max_size_mb=mixed.max_size_mb, pins=pins)
        st.key = content_key(measurement=run.hashes["measurement"], budget=budget)
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
    """The checkpoint against the reference (with ``evaluation.behaviour``, their replies too), and the reference's
    own perplexity (both cached)."""
    from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
    from quantkit.eval.behaviour import PROMPTS_FILE
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
        behaviour=None if ev.behaviour is None else ev.behaviour.config(run.show_progress),
        show_progress=run.show_progress,
    )
    # keyed by the prompts' content too; left out while off, so the keys of runs without behaviour stay valid
    replies = {} if ev.behaviour is None else {"behaviour": [ev.behaviour.model_dump(), files_hash([PROMPTS_FILE])]}
    quant_key = content_key(checkpoint=run.hashes["checkpoint files"], reference=ref_id, **params, **replies)
    quantized = _cached_eval(run, "evaluate", quant_key, str(output), config)
    base_key = content_key(model=ref_id, reference=None, **params)
    baseline = _cached_eval(
        run,
        "baseline",
        base_key,
        reference,
        replace(config, reference=None, behaviour=None),
        _baseline_from(quantized, reference),
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
    if quantized.get("behaviour") is not None:
        run.figures.update(behaviour_figures(quantized["behaviour"]))
    return quantized, baseline


def behaviour_figures(behaviour: dict[str, Any]) -> dict[str, Any]:
    """The report's figures of an evaluation's replies (quantkit.eval.behaviour)."""
    candidate, reference = behaviour["candidate"], behaviour["reference"]
    figures = {
        "end rate": candidate["end_rate"],
        "reference end rate": reference["end_rate"],
        "repetition": candidate["repetition"],
        "reference repetition": reference["repetition"],
        "first-32 agreement": behaviour["first32_agreement"],
        "behaviour prompts": behaviour["prompts"],
    }
    if behaviour["reasoning_tags"]:
        figures |= {
            "tag close rate": candidate["tag_close_rate"],
            "reference tag close rate": reference["tag_close_rate"],
        }
    return figures


def _baseline_from(quantized: dict[str, Any], reference: str) -> dict[str, Any] | None:
    """The reference's own evaluation, when the checkpoint's evaluation already ran it over the same tokens."""
    if quantized.get("reference_perplexity") is None:
        return None
    compared = ("kl_mean", "kl_p99", "top1_agreement", "reference_perplexity", "perplexity_change_pct", "behaviour")
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
