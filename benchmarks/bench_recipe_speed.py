"""Quantize time of shipped recipes against llm-compressor's plain GPTQ on the same calibration windows, side by side.

    python -m benchmarks.bench_recipe_speed --llmc-python /work/tmp/llmc-venv/bin/python --json speed.json \
        --recipes best-at-w4-size,best-at-w3-size --record recipe_speed

The recipes' own calibration section (they must agree) draws the windows once, into one file. Then, one after the
other in each round (the order reversed every other round): llm-compressor's ``oneshot`` with ``GPTQModifier``, W4 g64
symmetric with its defaults (benchmarks/llmc_worker.py, as bench_llmcompressor runs it), and each recipe's
quantization section on that file (benchmarks/recipe_quantize_worker.py: no evaluation or gates). Every run is a
subprocess timed the same way from outside: wall clock of the whole process (interpreter start, imports, model load,
calibration pass, save) and its peak RSS. With several rounds each row is the median of its runs.

Run it on an otherwise quiet machine: the ratio is only meaningful between runs that shared the cores with nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.bench_llmcompressor import Run, quantize_llmc, run, safetensors_mb, tail
from benchmarks.record import record_table

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
WORKER = "benchmarks.recipe_quantize_worker"
PEER = "llm-compressor GPTQ W4 g64"
COLUMNS = ["run", "what", "seconds", "ratio to llm-compressor", "peak RSS MB", "checkpoint MB", "verdict"]


def shared_calibration(recipes: dict[str, object], work: Path) -> Path:
    """The recipes' common calibration windows, drawn once into ``work`` (as a recipe run draws them)."""
    from quantkit.data.calibration import CalibrationConfig, build_calibration
    from quantkit.recipes.stages import section_fields

    sections = {name: section_fields(recipe.calibration) for name, recipe in recipes.items()}  # type: ignore[attr-defined]
    first_name, first = next(iter(sections.items()))
    for name, section in sections.items():
        if section != first:
            sys.exit(f"{name} and {first_name} calibrate differently ({section} vs {first}): time them separately")
    path = work / "calibration.safetensors"
    if not path.is_file():
        params = dict(first)
        dataset = params.pop("dataset")
        model = next(iter(recipes.values())).model  # type: ignore[attr-defined]
        build_calibration(model, CalibrationConfig(dataset=dataset, **params), output=path)
    return path


def what_recipe_does(recipe: object) -> str:
    q = recipe.quantization  # type: ignore[attr-defined]
    solvers = ", ".join(name for name, value in q.solvers.model_dump().items() if value is not None)
    from quantkit.device import resolve_device
    from quantkit.model.precision import DEFAULT_COMPUTE_DTYPE, resolve_compute_dtype

    # the forward passes' products on this machine: auto as the run resolves it
    dtype = resolve_compute_dtype(q.compute_dtype, resolve_device(recipe.device))  # type: ignore[attr-defined]
    if dtype != DEFAULT_COMPUTE_DTYPE:
        solvers += f"; {dtype} forward passes"
    if q.plan is not None:
        return f"plan {Path(q.plan).name}; {solvers}"
    scheme = q.quant_scheme()
    group = "per-channel" if scheme.group_size in (-1, None) else f"g{scheme.group_size}"
    return f"W{scheme.bits} {group}; {solvers}"


def measure(args: argparse.Namespace, console: Console) -> dict:
    """Every run of every round; the JSON :func:`report` reads (and ``--json`` keeps)."""
    from quantkit.data.calibration import CalibrationSet
    from quantkit.model.resolve import resolve_model
    from quantkit.recipes.schema import load_recipe

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    recipes = {name: load_recipe(RECIPES / f"{name}.yaml", args.set) for name in args.recipes.split(",") if name}
    calib = shared_calibration(recipes, work)
    model = next(iter(recipes.values())).model
    model_dir = resolve_model(model)
    runs: dict[str, list[Run]] = {PEER: [], **{name: [] for name in recipes}}
    sizes: dict[str, float] = {}
    llmc_info: dict = {}
    order = list(runs)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            out = work / name
            shutil.rmtree(out, ignore_errors=True)
            console.print(f"[bold]round {round_index + 1}: {name}[/]")
            if name == PEER:
                result, llmc_info = quantize_llmc("gptq", args.llmc_python, model_dir, calib, out, 4, 64, "auto", False)
            else:
                command = [sys.executable, "-m", WORKER, RECIPES / f"{name}.yaml", "--calib", calib, "--output", out]
                command += [part for key in args.set for part in ("--set", key)]
                result = run(command, work / f"{name}.log")
            if result.returncode != 0:
                sys.exit(f"{name} failed ({result.returncode}):\n{tail(result.log)}")
            runs[name].append(result)
            sizes[name] = safetensors_mb(out)
            console.print(f"  {result.seconds:.0f} s, peak RSS {result.peak_rss_mb:.0f} MB")
    if llmc_info and not llmc_info["calibration"]["same_windows_fed"]:
        sys.exit("llm-compressor was not fed exactly the calibration windows")
    windows = CalibrationSet.load(calib)
    return {
        "model": model,
        "rounds": args.rounds,
        "calibration": {"file": str(calib), "windows": windows.num_samples, "seq_len": windows.seq_len},
        "what": {name: what_recipe_does(recipe) for name, recipe in recipes.items()},
        "runs": {name: [vars(r) for r in results] for name, results in runs.items()},
        "sizes_mb": sizes,
        "llmc_info": llmc_info,
    }


def rows_of(data: dict) -> list[list[str]]:
    runs = data["runs"]
    median = {name: statistics.median(r["seconds"] for r in results) for name, results in runs.items()}
    rows = []
    for name, results in runs.items():
        what = "plain GPTQ, its defaults (actorder static, min-max observer)" if name == PEER else data["what"][name]
        ratio = median[name] / median[PEER]
        verdict = "-" if name == PEER else ("faster" if ratio < 1 else "slower")
        rss = statistics.median(r["peak_rss_mb"] for r in results)
        size = data["sizes_mb"][name]
        rows.append([name, what, f"{median[name]:.0f}", f"{ratio:.2f}", f"{rss:.0f}", f"{size:.1f}", verdict])
    return rows


def report(data: dict, args: argparse.Namespace, console: Console) -> None:
    rows = rows_of(data)
    table = Table(title=f"{data['model']}: recipe quantize time against llm-compressor's plain GPTQ, same windows")
    for column in COLUMNS:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if args.record:
        calibration = data["calibration"]
        record_table(
            args.record,
            title="Best-at-size recipes against llm-compressor's time",
            order=args.order,
            protocol=(
                f"The recipes' calibration windows ({calibration['windows']} x {calibration['seq_len']}, drawn once) "
                "fed to both; each run a subprocess timed from outside (wall clock of the whole process: start, "
                "imports, model load, calibration pass, save; peak RSS from wait4), one after the other on the same "
                f"otherwise quiet machine; {data['rounds']} round(s), median, the order reversed every other round. "
                "The recipes run their quantization section only (benchmarks/recipe_quantize_worker.py)."
            ),
            baseline=f"{PEER}: llm-compressor's oneshot with GPTQModifier on the same windows, bf16 as loaded",
            columns=COLUMNS,
            rows=rows,
            notes=["A recipe is 'faster' when its time is below llm-compressor's in the same run.", *args.note],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llmc-python", type=Path, default=None, help="python of the llm-compressor venv")
    parser.add_argument("--recipes", default="best-at-w4-size,best-at-w3-size", help="comma list under recipes/")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each (medians; the order alternates)")
    parser.add_argument("--work", type=Path, default=Path("/work/tmp/bench-recipe-speed"), help="files and logs")
    parser.add_argument("--set", action="append", default=[], help="override a key of every recipe (a smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="write every run as JSON")
    parser.add_argument("--from-json", type=Path, default=None, help="report (and record) a --json file's runs")
    parser.add_argument("--record", default=None, help="record the table as benchmarks/results/NAME.json")
    parser.add_argument("--order", type=int, default=52, help="the recorded table's place in docs/benchmarks.md")
    parser.add_argument("--note", action="append", default=[], help="a note for the recorded table (repeatable)")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 130))
    if args.from_json is not None:
        report(json.loads(args.from_json.read_text()), args, console)
        return
    if args.llmc_python is None or not args.llmc_python.is_file():
        parser.error(f"--llmc-python: the llm-compressor venv's python is required (got {args.llmc_python})")
    data = measure(args, console)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    report(data, args, console)


if __name__ == "__main__":
    main()
