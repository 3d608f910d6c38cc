"""Quality inside and outside the calibration domain, and the spread over calibration seeds.

Every row is calibrated on the shipped Austen corpus (as users calibrate on their own data) and evaluated twice
against the original model: on held-out *Persuasion* (Austen: in domain) and on held-out chapters 101-135 of
*Moby-Dick* (another author and era: out of domain). Each figure carries its standard error over the evaluation
windows; the paired column compares the row with the first row of its scheme on the out-of-domain text, window by
window, and says whether it is better, worse or indistinguishable.

    python -m benchmarks.bench_domains --matrix quality --record domains     # GPTQ with and without the quality setting
    python -m benchmarks.bench_domains --matrix seeds --record seeds         # one row, three calibration seeds

Each configuration is calibrated and quantized in its own process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.bench_quantize import FLOAT_TARGET_SAMPLES, Case, case
from benchmarks.record import record_table
from quantkit.data.sources import DEFAULT_EVALUATION, OUT_OF_DOMAIN_EVALUATION
from quantkit.eval.evaluate import EvalConfig, EvalResult, evaluate
from quantkit.format.inspect import inspect_checkpoint

IN, OUT = "in domain (Persuasion)", "out of domain (Moby-Dick 101-135)"
DOMAINS = {IN: DEFAULT_EVALUATION, OUT: OUT_OF_DOMAIN_EVALUATION}
GPTQ = {"act_order": True, "mse_clip": True}  # GPTQ's defaults, spelled out
QUALITY = {"rotate": "hadamard", "refit_head": True, "float_targets": True}


@dataclass(frozen=True)
class Row:
    label: str
    case: Case
    samples: int
    seed: int = 0
    against: str | None = None  # the label of the row the paired column compares with


def quality_rows(samples: int) -> list[Row]:
    """Per scheme: plain GPTQ, rotated GPTQ, rotated with the head refitted, and the quality setting (rotation,
    float targets, head refit) on 256 windows with and without the head refit."""
    rows = []
    for bits in (4, 3):
        name = f"W{bits} g64"
        plain = f"{name} GPTQ"
        rows += [
            Row(plain, case("gptq", bits, 64, True, **GPTQ), samples),
            Row(f"{name} GPTQ + rotation", case("gptq", bits, 64, True, **GPTQ, rotate="hadamard"), samples, 0, plain),
            Row(
                f"{name} GPTQ + rotation + head refit",
                case("gptq", bits, 64, True, **GPTQ, rotate="hadamard", refit_head=True),
                samples,
                0,
                plain,
            ),
            Row(
                f"{name} quality setting ({FLOAT_TARGET_SAMPLES} windows)",
                case("gptq", bits, 64, True, **GPTQ, **QUALITY),
                FLOAT_TARGET_SAMPLES,
                0,
                plain,
            ),
            Row(
                f"{name} quality setting without head refit ({FLOAT_TARGET_SAMPLES} windows)",
                case("gptq", bits, 64, True, **GPTQ, **(QUALITY | {"refit_head": False})),
                FLOAT_TARGET_SAMPLES,
                0,
                plain,
            ),
        ]
    # the rows that decide the defaults first (plain GPTQ and the quality setting at both widths), so that a run
    # stopped early has them
    first = [
        r for r in rows if r.against is None or r.label.endswith(f"quality setting ({FLOAT_TARGET_SAMPLES} windows)")
    ]
    return first + [r for r in rows if r not in first]


def seed_rows(samples: int) -> list[Row]:
    """W4 g64 GPTQ calibrated on three seeds' windows: how much of a difference between rows is the draw."""
    first = "W4 g64 GPTQ, seed 0"
    return [
        Row(f"W4 g64 GPTQ, seed {s}", case("gptq", 4, 64, True, **GPTQ), samples, s, None if s == 0 else first)
        for s in (0, 1, 2)
    ]


def quantize(row: Row, model: str, out: Path, seq_len: int) -> dict[str, Any]:
    calib, summary = out.with_suffix(".calib.safetensors"), out.with_suffix(".json")
    windows = ["--num-samples", str(row.samples), "--seq-len", str(seq_len), "--seed", str(row.seed)]
    make = [sys.executable, "-m", "quantkit", "calibrate", "--model", model, *windows, "-o", str(calib)]
    subprocess.run(make, check=True, stdout=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "quantkit", "quantize", model, "-o", str(out), "--force", "--json", str(summary)]
    subprocess.run([*cmd, "--calib", str(calib), *row.case.args()], check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text())


def _evaluate(path: Path, model: str, text: Path, windows: int, compare: Path | None) -> EvalResult:
    config = EvalConfig(dataset=str(text), max_windows=windows, reference=model, show_progress=False)
    config.compare = None if compare is None else str(compare)
    return evaluate(path, config)


def _cells(row: Row, size_mb: float, bpw: float, results: dict[str, EvalResult]) -> list[str]:
    cells = [row.label, f"{size_mb:.1f}", f"{bpw:.2f}"]
    for domain in DOMAINS:
        r = results[domain]
        cells += [
            f"{r.perplexity_change_pct:+.1f}% ± {r.perplexity_change_se:.1f}",
            f"{r.kl_mean:.4f} ± {r.kl_mean_se:.4f}",
        ]
    comparison = results[OUT].comparison
    if comparison is None:
        cells.append("")
    else:
        low, high = comparison["perplexity_ratio_ci95_pct"]
        cells.append(f"{comparison['perplexity_ratio_pct']:+.2f}% [{low:+.2f}, {high:+.2f}] {comparison['verdict']}")
    return cells


COLUMNS = ["row", "size MB", "bits/w", "ppl +% (in)", "KL (in)", "ppl +% (out)", "KL (out)", "paired ppl (out)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--matrix", choices=("quality", "seeds"), default="quality")
    parser.add_argument("--samples", type=int, default=128, help="calibration windows (quality setting: 256)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--only", default=None, help="comma list of row labels to run")
    parser.add_argument("--keep", type=Path, default=None, help="keep the checkpoints here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
    parser.add_argument("--record", default=None, help="record the table as benchmarks/results/NAME.json")
    parser.add_argument("--order", type=int, default=35, help="the recorded table's place on the page")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="table (and --record) from an earlier run's --json, rows as they are",
    )
    args = parser.parse_args()
    rows = quality_rows(args.samples) if args.matrix == "quality" else seed_rows(args.samples)
    if args.only:
        rows = [r for r in rows if r.label in set(args.only.split(","))]
    console = Console(width=max(Console().width, 160))
    cells, records = [], []
    if args.from_json is not None:  # a run stopped early: its finished rows, measured then
        by_label = {r["row"]: r for r in json.loads(args.from_json.read_text())}
        rows = [r for r in rows if r.label in by_label]
        records = [by_label[row.label] for row in rows]
        for row, record in zip(rows, records, strict=True):
            results = {d: SimpleNamespace(**record[d]) for d in DOMAINS}
            size_mb = record["quantize"]["checkpoint_bytes"] / 1e6
            cells.append(_cells(row, size_mb, record["bpw"], results))  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        paths: dict[str, Path] = {}
        for row in rows if args.from_json is None else []:
            console.print(f"[bold]{row.label}[/]")
            out = where / row.label.replace(" ", "_").replace("/", "_").replace("(", "").replace(")", "")
            summary = out.with_suffix(".json")
            q = (
                json.loads(summary.read_text())
                if args.keep and summary.exists()
                else quantize(row, args.model, out, args.seq_len)
            )
            paths[row.label] = out
            against = paths.get(row.against) if row.against else None
            results = {}
            for domain, text in DOMAINS.items():
                compare = against if domain == OUT else None
                results[domain] = _evaluate(out, args.model, text, args.eval_windows, compare)
            bpw = inspect_checkpoint(out).model_bits_per_weight
            cells.append(_cells(row, q["checkpoint_bytes"] / 1e6, bpw, results))
            records.append({"row": row.label, "seed": row.seed, "samples": row.samples, "quantize": q, "bpw": bpw}
                           | {d: r.to_dict() for d, r in results.items()})  # fmt: skip
            console.print("  " + " | ".join(cells[-1][3:]))
            if args.json:
                args.json.write_text(json.dumps(records, indent=1, default=str))
    table = Table(title=f"{args.model}: calibrated on Austen, evaluated in and out of domain")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("row", "paired ppl (out)") else "right")
    for row_cells in cells:
        table.add_row(*row_cells)
    console.print(table)
    if args.record:
        tokens = {d: records[0][d]["tokens"] for d in DOMAINS} if records else {}
        record_table(
            args.record,
            title="Inside and outside the calibration domain"
            if args.matrix == "quality"
            else "Calibration-seed spread",
            order=args.order,
            protocol=(
                f"Calibration: {args.samples} x {args.seq_len} windows of the shipped Austen corpus (the quality "
                f"setting: {FLOAT_TARGET_SAMPLES}), drawn with `quantkit calibrate --seed`; each row quantized in its "
                f"own process; evaluation: {args.eval_windows} windows of 512 tokens of held-out Persuasion "
                f"({tokens.get(IN, '?')} tokens) and of held-out Moby-Dick chapters 101-135 "
                f"({tokens.get(OUT, '?')} tokens), against the original model; ± is one standard error "
                "over windows; the paired column is the perplexity ratio to the row it names on Moby-Dick, per "
                "window, with its 95% interval."
            ),
            baseline="the original model on the same windows (ppl +% and KL are against it)",
            columns=COLUMNS,
            rows=cells,
            notes=[f"{r.label}: paired against {r.against}" for r in rows if r.against],
        )


if __name__ == "__main__":
    main()
