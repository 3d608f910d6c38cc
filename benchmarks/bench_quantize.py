"""Benchmark quantization methods and schemes on SmolLM2: time, peak RSS, size, perplexity and KL.

Each configuration is quantized in its own process (`quantkit quantize --json`), so its peak RSS is its own,
then evaluated on the held-out text against the original model in this process. Prints one table, with the
original model's perplexity as the baseline row and each RTN row's gap closed by the matching GPTQ/AWQ row.

    python -m benchmarks.bench_quantize                     # the full matrix (long on 2 CPU cores)
    python -m benchmarks.bench_quantize --only w4-g64-sym --methods rtn,gptq --eval-windows 20
    python -m benchmarks.bench_quantize --matrix frontier --samples 40    # W4/W3 schemes with rotation and tuning
    python -m benchmarks.bench_quantize --matrix calibration              # W4 g64 calibrated on three texts
    python -m benchmarks.bench_quantize --matrix calibration --float-targets   # the same with the best W4 method
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.record import record_table
from quantkit.eval.evaluate import EvalConfig, evaluate
from quantkit.format.inspect import inspect_checkpoint
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import METHOD_ROLES
from quantkit.quantization.methods.tune import TuneConfig
from quantkit.quantization.options import config_from_options, options_to_args

# The scheme options whose defaults depend on the method: every row spells them out, so that a change of a
# method's defaults never changes what a row measures.
SPELLED_OUT = {"act_order": False, "static_groups": True, "mse_clip": False}


@dataclass(frozen=True)
class Case:
    """One row: ``quantkit quantize`` options (by their parameter names, :func:`job_options`), and the
    calibration text and window count when they are not the run's."""

    options: tuple[tuple[str, Any], ...]
    dataset: str | None = None  # calibration text (None: the default, Austen prose)
    samples: int | None = None  # calibration windows (None: the run's --samples)

    @property
    def values(self) -> dict[str, Any]:
        return SPELLED_OUT | dict(self.options)

    @property
    def config(self) -> QuantizeConfig:
        return config_from_options(self.values)

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def storage(self) -> str:
        """The stored layout (what RTN is compared at), without solver options."""
        return "-".join(self.config.resolved_scheme().name.split("-")[:3])

    @property
    def scheme(self) -> str:
        """The scheme's name, each algorithm beyond the method with the options it does not leave at their
        defaults, the window count and the calibration text when they are the row's own."""
        config = self.config
        label = config.resolved_scheme().name
        for step in config.steps:
            if step.algorithm.role in METHOD_ROLES:
                continue
            changed = {
                f.name: getattr(step.config, f.name)
                for f in dataclasses.fields(step.config)
                if getattr(step.config, f.name) != getattr(type(step.config)(), f.name)
            }
            label += f"+{step.name}" + (f"({', '.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")
        return (
            label
            + (f"-{self.samples}w" if self.samples else "")
            + (f" [{Path(self.dataset).stem}]" if self.dataset else "")
        )

    def args(self) -> list[str]:
        return options_to_args(self.values)


def case(method: str, bits: int, group: int, sym: bool, *, dataset: str | None = None, samples: int | None = None,
         **options: Any) -> Case:  # fmt: skip
    base = {"method": method, "bits": bits, "group_size": group, "sym": sym}
    return Case(tuple((base | options).items()), dataset, samples)


def matrix(methods: list[str]) -> list[Case]:
    cases = []
    for group in (32, 64, 128):
        for sym in (True, False):
            cases += [case(m, 4, group, sym) for m in methods]
            if "gptq" in methods:  # the GPTQ default (act-order, static groups, MSE clip) and act-order alone
                cases.append(case("gptq", 4, group, sym, act_order=True))
                cases.append(case("gptq", 4, group, sym, act_order=True, mse_clip=True))
    cases += [case(m, 8, -1, True) for m in methods]
    if "gptq" in methods:
        cases.append(case("gptq", 8, -1, True, act_order=True, mse_clip=True))
    return cases


# Float targets are a regression on the calibration tokens: they are measured with this many windows.
FLOAT_TARGET_SAMPLES = 256


def frontier(tune_steps: int) -> list[Case]:
    """The deployable low-bit schemes: round-to-nearest, then GPTQ's default with and without rotation and tuning,
    rotated and tuned with the head refitted, and rotated with float targets and the head refitted (at the run's
    windows and at :data:`FLOAT_TARGET_SAMPLES`)."""
    cases = []
    best = {"act_order": True, "mse_clip": True}  # GPTQ's defaults, spelled out
    for bits, group in ((4, 64), (4, -1), (3, 64), (3, 32)):
        cases.append(case("rtn", bits, group, True))
        for rotate in ("none", "hadamard"):
            for steps in (0, tune_steps):
                cases.append(case("gptq", bits, group, True, **best, rotate=rotate, tune_steps=steps))
        cases.append(case("gptq", bits, group, True, **best, rotate="hadamard", tune_steps=tune_steps, refit_head=True))
        for samples in (None, FLOAT_TARGET_SAMPLES):
            quality = {"rotate": "hadamard", "refit_head": True, "float_targets": True}
            cases.append(case("gptq", bits, group, True, **best, **quality, samples=samples))
    return cases


# Calibration robustness: the same scheme calibrated on three texts, evaluated on the same held-out Persuasion.
CALIBRATION_TEXTS = ("austen_calibration.jsonl", "austen_chat.jsonl", "melville_mobydick.jsonl")
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibration"


def calibration(tune_steps: int, rotate: bool, float_targets: bool) -> list[Case]:
    """W4 g64 sym, GPTQ default (with the frontier's rotation and tuning choice, or rotated with float targets and
    the head refitted on :data:`FLOAT_TARGET_SAMPLES` windows), once per calibration text."""
    gptq = {"act_order": True, "mse_clip": True}
    if float_targets:
        quality = {"rotate": "hadamard", "refit_head": True, "float_targets": True}
        best = case("gptq", 4, 64, True, **gptq, **quality, samples=FLOAT_TARGET_SAMPLES)
    else:
        best = case("gptq", 4, 64, True, **gptq, rotate="hadamard" if rotate else "none", tune_steps=tune_steps)
    return [dataclasses.replace(best, dataset=str(CALIBRATION_DIR / t)) for t in CALIBRATION_TEXTS]


def quantize(case: Case, model: str, out: Path, samples: int, seq_len: int) -> dict:
    summary = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "quantkit", "quantize", model, "-o", str(out), "--force", "--json", str(summary)]
    samples = case.samples or samples
    if case.dataset:  # windows from that text, drawn as quantize draws them from the shipped corpus
        calib = out.with_suffix(".calib.safetensors")
        windows = ["--num-samples", str(samples), "--seq-len", str(seq_len)]
        make = [sys.executable, "-m", "quantkit", "calibrate", "--model", model, "--dataset", case.dataset, *windows]
        subprocess.run([*make, "-o", str(calib)], check=True, stdout=subprocess.DEVNULL)
        cmd += ["--calib", str(calib), *case.args()]
    else:
        cmd += ["--num-samples", str(samples), "--seq-len", str(seq_len), *case.args()]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="rtn,gptq", help="comma list of rtn, gptq, awq, awq+gptq")
    parser.add_argument("--matrix", choices=("methods", "frontier", "calibration"), default="methods")
    parser.add_argument(
        "--tune-steps", type=int, default=TuneConfig().steps, help="frontier, calibration: tuning steps per block"
    )
    parser.add_argument("--no-rotate", action="store_true", help="calibration: without the Hadamard rotation")
    parser.add_argument(
        "--float-targets", action="store_true", help="calibration: rotated, float targets, head refitted, 256 windows"
    )
    parser.add_argument(
        "--only", default=None, help="comma list of scheme names or method:scheme, e.g. w8-ch-sym,rtn:w4-g64-sym"
    )
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
    parser.add_argument("--record", default=None, help="record the table as benchmarks/results/NAME.json")
    parser.add_argument("--title", default=None, help="the recorded table's title")
    parser.add_argument("--order", type=int, default=10, help="the recorded table's place on the page")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if args.matrix == "methods":
        cases = matrix(methods)
    elif args.matrix == "frontier":
        cases = frontier(args.tune_steps)
    else:
        cases = calibration(args.tune_steps, rotate=not args.no_rotate, float_targets=args.float_targets)
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in cases if c.scheme in wanted or f"{c.method}:{c.scheme}" in wanted]
    console = Console(width=max(Console().width, 140))  # wide tables stay readable in logs
    base = evaluate(args.model, EvalConfig(max_windows=args.eval_windows, show_progress=False))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            console.print(f"[bold]{case.method} {case.scheme}[/]")
            out = Path(tmp) / f"{case.method}-{case.scheme}"
            q = quantize(case, args.model, out, args.samples, args.seq_len)
            e = evaluate(out, EvalConfig(max_windows=args.eval_windows, reference=args.model, show_progress=False))
            rows.append(
                {
                    "method": case.method,
                    "scheme": case.scheme,
                    "storage": case.storage,
                    "seconds": q["seconds"],
                    "peak_rss_mb": q["peak_rss_mb"],
                    "size_mb": q["checkpoint_bytes"] / 1e6,
                    "model_bits_per_weight": inspect_checkpoint(out).model_bits_per_weight,
                    "perplexity": e.perplexity,
                    "kl_mean": e.kl_mean,
                    "kl_p99": e.kl_p99,
                    "top1": e.top1_agreement,
                }
            )
            r = rows[-1]  # each row as it lands, so a stopped run keeps the finished ones
            console.print(f"  ppl {r['perplexity']:.3f}, KL {r['kl_mean']:.4f}, {r['seconds']:.0f} s")
            if args.json:
                args.json.write_text(json.dumps({"baseline_perplexity": base.perplexity, "rows": rows}, indent=2))
    columns = ["method", "scheme", "time s", "peak RSS MB", "size MB", "bits/w", "ppl", "ppl +%", "KL mean"]
    columns += ["KL p99", "top-1"]
    cells = [
        [
            r["method"],
            r["scheme"],
            f"{r['seconds']:.0f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['size_mb']:.1f}",
            f"{r['model_bits_per_weight']:.2f}",
            f"{r['perplexity']:.2f}",
            f"{100 * (r['perplexity'] / base.perplexity - 1):+.1f}%",
            f"{r['kl_mean']:.3f}",
            f"{r['kl_p99']:.2f}",
            f"{r['top1']:.3f}",
        ]
        for r in rows
    ]
    table = Table(
        title=f"Quantization on {args.model}: {args.samples} x {args.seq_len} calibration windows, "
        f"{base.tokens} held-out tokens (baseline perplexity {base.perplexity:.3f})"
    )
    for col in columns:
        table.add_column(col, justify="right")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"baseline_perplexity": base.perplexity, "rows": rows}, indent=2))
    if args.record:
        windows = f"{base.windows} held-out windows of {EvalConfig.seq_len} tokens"
        record_table(
            args.record,
            title=args.title or f"Quantization methods on {args.model}",
            order=args.order,
            protocol=f"Calibration: {args.samples} x {args.seq_len} windows of the shipped Austen corpus (seed 0), "
            f"unless a row names its own text or count; each row quantized in its own process, one after the "
            f"other; evaluation: {windows} ({base.tokens} tokens).",
            baseline=f"the original model's perplexity {base.perplexity:.2f}",
            columns=columns,
            rows=cells,
        )


if __name__ == "__main__":
    main()
