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

from rich.console import Console
from rich.table import Table

from quantkit.eval.evaluate import EvalConfig, evaluate
from quantkit.format.inspect import inspect_checkpoint
from quantkit.quantization.solvers.tune import TuneConfig


@dataclass(frozen=True)
class Case:
    method: str
    bits: int
    group: int
    sym: bool
    act_order: bool = False
    mse_clip: bool = False
    rotate: bool = False
    tune_steps: int = 0
    refit_head: bool = False
    float_targets: bool = False
    dataset: str | None = None  # calibration text (None: the default, Austen prose)
    samples: int | None = None  # calibration windows (None: the run's --samples)

    @property
    def storage(self) -> str:
        """The stored layout (what RTN is compared at), without solver options."""
        group = "ch" if self.group == -1 else f"g{self.group}"
        return f"w{self.bits}-{group}-{'sym' if self.sym else 'asym'}"

    @property
    def scheme(self) -> str:
        solver = ("-actorder" if self.act_order else "") + ("-mse" if self.mse_clip else "")
        solver += "-float" if self.float_targets else ""
        return (
            self.storage
            + solver
            + ("-rot" if self.rotate else "")
            + (f"-tune{self.tune_steps}" if self.tune_steps else "")
            + ("-refit" if self.refit_head else "")
            + (f"-{self.samples}w" if self.samples else "")
            + (f" [{Path(self.dataset).stem}]" if self.dataset else "")
        )

    def args(self) -> list[str]:
        """Every solver option spelled out, so the CLI's method defaults never change what a row means."""
        out = ["--method", self.method, "--bits", str(self.bits), "--group-size", str(self.group)]
        out.append("--sym" if self.sym else "--asym")
        out += ["--act-order", "--static-groups"] if self.act_order else ["--no-act-order"]
        out.append("--mse-clip" if self.mse_clip else "--no-mse-clip")
        out += ["--rotate", "hadamard" if self.rotate else "none", "--tune-steps", str(self.tune_steps)]
        out.append("--refit-head" if self.refit_head else "--no-refit-head")
        if self.method.endswith("gptq"):
            out.append("--float-targets" if self.float_targets else "--no-float-targets")
        return out


def matrix(methods: list[str]) -> list[Case]:
    cases = []
    for group in (32, 64, 128):
        for sym in (True, False):
            cases += [Case(m, 4, group, sym) for m in methods]
            if "gptq" in methods:  # the GPTQ default (act-order, static groups, MSE clip) and act-order alone
                cases.append(Case("gptq", 4, group, sym, act_order=True))
                cases.append(Case("gptq", 4, group, sym, act_order=True, mse_clip=True))
    cases += [Case(m, 8, -1, True) for m in methods]
    if "gptq" in methods:
        cases.append(Case("gptq", 8, -1, True, act_order=True, mse_clip=True))
    return cases


# Float targets are a regression on the calibration tokens: they are measured with this many windows.
FLOAT_TARGET_SAMPLES = 256


def frontier(tune_steps: int) -> list[Case]:
    """The deployable low-bit schemes: round-to-nearest, then GPTQ's default with and without rotation and tuning,
    rotated and tuned with the head refitted, and rotated with float targets and the head refitted (at the run's
    windows and at :data:`FLOAT_TARGET_SAMPLES`)."""
    cases = []
    for bits, group in ((4, 64), (4, -1), (3, 64), (3, 32)):
        cases.append(Case("rtn", bits, group, True))
        for rotate in (False, True):
            for steps in (0, tune_steps):
                cases.append(Case("gptq", bits, group, True, True, True, rotate=rotate, tune_steps=steps))
        cases.append(Case("gptq", bits, group, True, True, True, True, tune_steps, refit_head=True))
        for samples in (None, FLOAT_TARGET_SAMPLES):
            cases.append(
                Case("gptq", bits, group, True, True, True, True, refit_head=True, float_targets=True, samples=samples)
            )
    return cases


# Calibration robustness: the same scheme calibrated on three texts, evaluated on the same held-out Persuasion.
CALIBRATION_TEXTS = ("austen_calibration.jsonl", "austen_chat.jsonl", "melville_mobydick.jsonl")
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibration"


def calibration(tune_steps: int, rotate: bool, float_targets: bool) -> list[Case]:
    """W4 g64 sym, GPTQ default (with the frontier's rotation and tuning choice, or rotated with float targets and
    the head refitted on :data:`FLOAT_TARGET_SAMPLES` windows), once per calibration text."""
    if float_targets:
        best = Case("gptq", 4, 64, True, True, True, True, refit_head=True, float_targets=True)
        best = dataclasses.replace(best, samples=FLOAT_TARGET_SAMPLES)
    else:
        best = Case("gptq", 4, 64, True, True, True, rotate=rotate, tune_steps=tune_steps)
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
    parser.add_argument("--only", default=None, help="comma list of scheme names, e.g. w4-g64-sym,w8-ch-sym")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
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
        cases = [c for c in cases if c.scheme in wanted]
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
    rtn = {r["storage"]: r["perplexity"] for r in rows if r["method"] == "rtn" and r["scheme"] == r["storage"]}
    table = Table(
        title=f"Quantization on {args.model}: {args.samples} x {args.seq_len} calibration windows, "
        f"{base.tokens} held-out tokens (baseline perplexity {base.perplexity:.3f})"
    )
    for col in (
        "method",
        "scheme",
        "time s",
        "peak RSS MB",
        "size MB",
        "bits/w",
        "ppl",
        "ppl +%",
        "KL mean",
        "KL p99",
        "top-1",
        "RTN gap closed",
    ):
        table.add_column(col, justify="right")
    table.add_row("original", "bf16", "-", "-", "-", "16", f"{base.perplexity:.3f}", "0", "0", "0", "1", "-")
    for r in rows:
        gap = rtn.get(r["storage"])
        closed = "-"
        if r["method"] != "rtn" and gap is not None and gap > base.perplexity:
            closed = f"{(gap - r['perplexity']) / (gap - base.perplexity):.0%}"
        table.add_row(
            r["method"],
            r["scheme"],
            f"{r['seconds']:.0f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['size_mb']:.1f}",
            f"{r['model_bits_per_weight']:.2f}",
            f"{r['perplexity']:.3f}",
            f"{100 * (r['perplexity'] / base.perplexity - 1):.2f}",
            f"{r['kl_mean']:.4f}",
            f"{r['kl_p99']:.3f}",
            f"{r['top1']:.3f}",
            closed,
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"baseline_perplexity": base.perplexity, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
