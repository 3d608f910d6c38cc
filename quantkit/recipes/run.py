"""Run a recipe: calibrate -> (sensitivity -> plan) -> quantize -> evaluate -> gates -> smoke, with a report.

Work is reused by content hash under ``cache_dir()/recipes``: calibration windows (model identity, source text
hash, calibration parameters), sensitivity measurements (model, calibration hash, candidates, mode) and
evaluation results (checkpoint file hash or model identity, reference, evaluation text hash, parameters). A
checkpoint already in ``output.directory`` whose ``quantkit_log.json`` fingerprints (model, calibration data,
scheme) match is reused instead of quantizing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from quantkit.errors import QuantkitError
from quantkit.model.cache import cache_dir
from quantkit.recipes.schema import Recipe, recipe_to_dict

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


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


class _Run:
    """State shared by the stages of one run."""

    def __init__(self, recipe: Recipe, console: Console | None, show_progress: bool) -> None:
        self.recipe = recipe
        self.console = console
        self.show_progress = show_progress
        self.stages: list[StageRecord] = []
        self.hashes: dict[str, str] = {}
        self.figures: dict[str, Any] = {}
        self.root = cache_dir() / "recipes"

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        record = StageRecord(name, 0.0, False)
        start = time.perf_counter()
        yield record
        record.seconds = time.perf_counter() - start
        self.stages.append(record)
        if self.console is not None:
            tag = " [cyan](cached)[/]" if record.cached else ""
            detail = f"  {record.detail}" if record.detail else ""
            self.console.print(f"[green]✓[/] {name:<12} {record.seconds:7.1f} s{tag}{detail}")


def run_recipe(
    recipe: Recipe,
    *,
    recipe_path: Path | None = None,
    report_dir: Path | None = None,
    console: Console | None = None,
    show_progress: bool = True,
) -> RecipeReport:
    """Run every stage of ``recipe``; write report.json and report.md; return the report (gates decided)."""
    run = _Run(recipe, console, show_progress)
    output = Path(recipe.output.directory)
    report_dir = Path(report_dir) if report_dir is not None else output / "report"
    model_path, model_id = _model_stage(run)
    calib_path = _calibration_stage(run, model_id)
    plan_path = _mixed_stages(run, model_id, calib_path) if recipe.quantization.mixed is not None else None
    if recipe.quantization.plan is not None:
        plan_path = Path(recipe.quantization.plan)
    _quantize_stage(run, model_path, calib_path, plan_path, output)
    quantized, baseline = _evaluate_stages(run, model_id, output)
    gates = _gates(recipe, quantized, baseline)
    smoke = _smoke_stage(run, output)
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
    )
    write_report(report, report_dir)
    return report


# --------------------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------------------


def _key(**parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _file_hash(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()[:20]


def checkpoint_hash(directory: Path) -> str:
    """Content hash of a checkpoint: its safetensors shards and config.json."""
    return _file_hash([*sorted(directory.glob("*.safetensors")), directory / "config.json"])


def model_identity(path: Path) -> str:
    """The weights' fingerprint plus the tokenizer files: what calibration and evaluation depend on."""
    from quantkit.model.source_weights import SourceWeights

    tokenizer = [path / name for name in _TOKENIZER_FILES if (path / name).is_file()]
    return _key(weights=SourceWeights(path).fingerprint(), tokenizer=_file_hash(tokenizer))


# --------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------


def _model_stage(run: _Run) -> tuple[Path, str]:
    from quantkit.model.resolve import resolve_model

    with run.stage("model") as st:
        path = resolve_model(run.recipe.model)
        identity = model_identity(path)
        st.key, st.detail = identity, str(path)
    run.hashes["model"] = identity
    return path, identity


def _calibration_stage(run: _Run, model_id: str) -> Path:
    from quantkit.data.calibration import CalibrationSet, build_calibration
    from quantkit.data.calibration_config import CalibrationConfig
    from quantkit.data.sources import load_documents

    cal = run.recipe.calibration
    with run.stage("calibrate") as st:
        source_hash = load_documents(cal.dataset, text_column=cal.text_column).content_hash
        params = asdict(cal)
        params.pop("dataset")
        st.key = _key(model=model_id, source=source_hash, params=params)
        path = run.root / "calibration" / f"{st.key}.safetensors"
        st.cached = path.is_file()
        if st.cached:
            calibration = CalibrationSet.load(path)
        else:
            config = CalibrationConfig(
                model=run.recipe.model, dataset=cal.dataset, output=path, show_progress=run.show_progress, **params
            )
            calibration = build_calibration(config).calibration
        st.detail = f"{calibration.num_samples} x {calibration.seq_len}"
    run.hashes["calibration source"] = source_hash[:20]
    run.hashes["calibration"] = st.key
    run.figures["calibration windows"] = calibration.num_samples
    run.figures["calibration seq_len"] = calibration.seq_len
    return path


def _mixed_stages(run: _Run, model_id: str, calib_path: Path) -> Path:
    from quantkit.mixed.measurement import load_measurement
    from quantkit.mixed.plan_file import save_plan
    from quantkit.mixed.planner import plan
    from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity

    mixed = run.recipe.quantization.mixed
    assert mixed is not None
    with run.stage("sensitivity") as st:
        solver = run.recipe.quantization.quant_scheme()
        st.key = _key(
            model=model_id,
            calibration=run.hashes["calibration"],
            candidates=mixed.candidates,
            mode=mixed.mode,
            damp=run.recipe.quantization.damp,
            act_order=solver.act_order,
            mse_clip=solver.mse_clip,
        )
        path = run.root / "measurement" / f"{st.key}.json"
        st.cached = path.is_file()
        if st.cached:
            measurement = load_measurement(path)
        else:
            config = SensitivityConfig(
                model=run.recipe.model,
                output=path,
                calib=calib_path,
                candidates=list(mixed.candidates),
                mode=mixed.mode,
                damp=run.recipe.quantization.damp,
                act_order=solver.act_order,
                mse_clip=solver.mse_clip,
                show_progress=run.show_progress,
            )
            measurement = measure_sensitivity(config)
        st.detail = f"{len(measurement.units)} units, mode {mixed.mode}"
    run.hashes["measurement"] = st.key
    with run.stage("plan") as st:
        chosen = plan(
            measurement, target_bits=mixed.target_bits, max_size_mb=mixed.max_size_mb, pins=list(mixed.pins.items())
        )
        st.key = _key(measurement=run.hashes["measurement"], budget=[mixed.target_bits, mixed.max_size_mb])
        plan_path = save_plan(chosen, run.root / "plans" / f"{st.key}-{_key(pins=mixed.pins)}.yaml")
        st.detail = f"{chosen.bits_per_weight:.3f} bits/weight"
    run.figures["planned bits per weight"] = round(chosen.bits_per_weight, 4)
    run.figures["planned size MB"] = round(chosen.size_mb, 3)
    return plan_path


def _quantize_config(run: _Run, calib_path: Path, plan_path: Path | None, output: Path, force: bool):
    from quantkit.quantize.config import QuantizeConfig

    q = run.recipe.quantization
    return QuantizeConfig(
        model=run.recipe.model,
        output=output,
        method=q.method,
        scheme=q.quant_scheme(),
        damp=q.damp,
        calib=calib_path,
        ignore=list(q.ignore),
        plan=plan_path,
        force=force,
        show_progress=run.show_progress,
    )


def expected_fingerprints(config: Any, model_path: Path, calib_path: Path) -> dict[str, str]:
    """The fingerprints quantize_model would record for ``config`` (same helpers as the pipeline)."""
    from quantkit.data.calibration import CalibrationSet
    from quantkit.model.resolve import arch_for_dir
    from quantkit.model.source_weights import SourceWeights, config_json
    from quantkit.quantize.pipeline import _assignment, _scheme_fingerprint

    config.validate()
    assignment = _assignment(config, arch_for_dir(model_path), int(config_json(model_path)["num_hidden_layers"]))
    ids = CalibrationSet.load(calib_path).input_ids
    return {
        "model": SourceWeights(model_path).fingerprint(),
        "calibration data": hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16],
        "scheme": _scheme_fingerprint(config, assignment),
    }


def _existing_fingerprints(output: Path) -> dict[str, str] | None:
    from quantkit.quantize.pipeline import LOG_FILE

    log = output / LOG_FILE
    if not log.is_file() or not any(output.glob("*.safetensors")):
        return None
    try:
        return dict(json.loads(log.read_text()).get("fingerprints") or {})
    except (json.JSONDecodeError, AttributeError):
        return None


def _quantize_stage(run: _Run, model_path: Path, calib_path: Path, plan_path: Path | None, output: Path) -> None:
    from quantkit.quantize.pipeline import quantize_model

    force = run.recipe.output.force
    with run.stage("quantize") as st:
        config = _quantize_config(run, calib_path, plan_path, output, force=True)
        expected = expected_fingerprints(config, model_path, calib_path)
        st.key = _key(**expected)
        found = _existing_fingerprints(output)
        st.cached = found == expected
        if not st.cached:
            if output.exists() and not force:
                differs = [k for k in expected if found and found.get(k) != expected[k]]
                why = f"its {', '.join(differs)} differ" if differs else "it is not a quantkit checkpoint"
                raise QuantkitError(
                    f"output directory '{output}' exists and does not hold this recipe's checkpoint ({why}); "
                    "set output.force: true (or --set output.force=true) to replace it"
                )
            result = quantize_model(config)
            # the peak of the whole process: with a kl/hybrid sensitivity stage before, that stage's peak counts
            measured = any(r.name == "sensitivity" and not r.cached for r in run.stages)
            label = "peak RSS MB (process, incl. sensitivity)" if measured else "quantize peak RSS MB"
            run.figures[label] = round(result.peak_rss_mb, 1)
        st.detail = str(output)
    run.hashes["checkpoint fingerprints"] = st.key
    run.hashes["checkpoint files"] = checkpoint_hash(output)
    run.figures["checkpoint MB"] = round(sum(f.stat().st_size for f in output.glob("*.safetensors")) / 1e6, 3)


def _cached_eval(run: _Run, name: str, key: str, config: Any) -> dict[str, Any]:
    from quantkit.atomic import write_json
    from quantkit.eval.evaluate import evaluate

    with run.stage(name) as st:
        st.key = key
        path = run.root / "eval" / f"{key}.json"
        st.cached = path.is_file()
        if st.cached:
            result = json.loads(path.read_text())
        else:
            result = evaluate(config).to_dict()
            write_json(path, result)
        st.detail = f"ppl {result['perplexity']:.3f} over {result['windows']} windows"
    return result


def _evaluate_stages(run: _Run, model_id: str, output: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
    from quantkit.eval.eval_config import EvalConfig
    from quantkit.model.resolve import resolve_model

    ev = run.recipe.evaluation
    reference = ev.reference or run.recipe.model
    ref_id = model_id if reference == run.recipe.model else model_identity(resolve_model(reference))
    dataset_hash = load_documents(ev.dataset or str(DEFAULT_EVALUATION)).content_hash
    params = {"seq_len": ev.seq_len, "windows": ev.windows, "dataset": dataset_hash}

    def config(model: str, ref: str | None) -> EvalConfig:
        return EvalConfig(
            model=model,
            dataset=ev.dataset,
            seq_len=ev.seq_len,
            max_windows=ev.windows,
            reference=ref,
            batch_size=ev.batch_size,
            show_progress=run.show_progress,
        )

    quant_key = _key(checkpoint=run.hashes["checkpoint files"], reference=ref_id, **params)
    quantized = _cached_eval(run, "evaluate", quant_key, config(str(output), reference))
    base_key = _key(model=ref_id, reference=None, **params)
    baseline = _cached_eval(run, "baseline", base_key, config(reference, None))
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


def _gates(recipe: Recipe, quantized: dict[str, Any], baseline: dict[str, Any]) -> list[GateResult]:
    g = recipe.gates
    measured = {
        "max_ppl_increase_pct": (quantized["perplexity"] / baseline["perplexity"] - 1) * 100,
        "max_kl_mean": quantized["kl_mean"],
        "min_top1_agreement": quantized["top1_agreement"],
    }
    results = []
    for name, threshold in (
        ("max_ppl_increase_pct", g.max_ppl_increase_pct),
        ("max_kl_mean", g.max_kl_mean),
        ("min_top1_agreement", g.min_top1_agreement),
    ):
        if threshold is None:
            continue
        value = float(measured[name])
        is_max = name.startswith("max_")
        margin = threshold - value if is_max else value - threshold
        results.append(GateResult(name, value, float(threshold), "<=" if is_max else ">=", margin >= 0, margin))
    return results


def _smoke_stage(run: _Run, output: Path) -> dict[str, Any] | None:
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


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


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


def write_report(report: RecipeReport, directory: Path) -> None:
    from quantkit.atomic import write_json

    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / REPORT_JSON, report.to_dict())
    (directory / REPORT_MD).write_text(render_markdown(report))


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
