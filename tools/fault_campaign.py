"""Random-kill campaign: quantize, `kill -9` at a random moment, resume, and compare with an uninterrupted run.

    python -m tools.fault_campaign --runs 30 --json campaign.json   # GPTQ W4 g64 on SmolLM2

Each run starts from nothing, is killed (SIGKILL) at a moment drawn uniformly over the reference run's wall time,
then resumed with `--resume` until it exits; its output must be byte-identical to the reference and nothing may be
left beside it. Prints kills / resumed / bit-identical / leftovers and writes them as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

FILES = ("model.safetensors", "config.json")


def _command(args: argparse.Namespace, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "quantkit", "quantize", args.model, "-o", str(out), "--method", args.method,
        "--bits", str(args.bits), "--group-size", str(args.group_size), "--num-samples", str(args.num_samples),
        *extra,
    ]  # fmt: skip


def _digest(out: Path) -> str:
    digest = hashlib.sha256()
    for name in FILES:
        digest.update((out / name).read_bytes())
    return digest.hexdigest()


def _first_difference(out: Path, reference: Path) -> str | None:
    """The first tensor (in file order) whose bytes differ from the reference's, with its largest difference."""
    from safetensors import safe_open

    with safe_open(str(out / FILES[0]), "pt") as got, safe_open(str(reference / FILES[0]), "pt") as want:
        for name in want.keys():  # noqa: SIM118 -- safe_open has keys(), not iteration
            a, b = got.get_tensor(name), want.get_tensor(name)
            if a.shape != b.shape or not a.equal(b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
                return f"{name} (max |diff| {diff:.3g})"
    return None


def _run(command: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
    return done.returncode, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=128, help="calibration windows (fewer: shorter runs)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("fault-campaign"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    console = Console()
    rng = random.Random(args.seed)
    args.workdir.mkdir(parents=True, exist_ok=True)

    reference = args.workdir / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    code, wall = _run(_command(args, reference))
    if code != 0:
        console.print(f"the reference run failed (exit {code})")
        return 1
    expected = _digest(reference)
    console.print(f"reference: {wall:.1f} s, sha256 {expected[:16]}")

    trials = []
    for i in range(args.runs):
        trial_dir = args.workdir / f"run-{i:02d}"
        shutil.rmtree(trial_dir, ignore_errors=True)
        trial_dir.mkdir()
        out = trial_dir / "out"
        delay = rng.uniform(0.5, wall)
        process = subprocess.Popen(_command(args, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        killed = process.poll() is None
        if killed:
            process.send_signal(signal.SIGKILL)
        process.wait()
        code, _ = _run(_command(args, out, "--resume"))
        identical = code == 0 and _digest(out) == expected
        leftovers = sorted(p.name for p in trial_dir.iterdir() if p.name != "out")
        differs = None if identical or code != 0 else _first_difference(out, reference)
        trials.append({"delay_s": round(delay, 1), "killed": killed, "resume_exit": code, "identical": identical,
                       "leftovers": leftovers, "first_difference": differs})  # fmt: skip
        console.print(f"run {i}: killed at {delay:.1f} s, resume exit {code}, identical {identical}, {leftovers}"
                      + (f", first difference: {differs}" if differs else ""))  # fmt: skip
        if identical:
            shutil.rmtree(trial_dir)  # a failing trial is kept for inspection

    summary = {
        "model": args.model,
        "method": args.method,
        "num_samples": args.num_samples,
        "reference_seconds": round(wall, 1),
        "runs": len(trials),
        "kills": sum(t["killed"] for t in trials),
        "resumed": sum(t["resume_exit"] == 0 for t in trials),
        "bit_identical": sum(t["identical"] for t in trials),
        "with_leftovers": sum(bool(t["leftovers"]) for t in trials),
        "trials": trials,
    }
    title = f"Fault campaign: {args.method} W{args.bits} g{args.group_size}, {args.num_samples} windows, {args.model}"
    table = Table(title=title)
    for column in ("runs", "kills", "resumed", "bit-identical", "with leftovers"):
        table.add_column(column, justify="right")
    table.add_row(*(str(summary[k]) for k in ("runs", "kills", "resumed", "bit_identical", "with_leftovers")))
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    ok = summary["bit_identical"] == summary["runs"] and not summary["with_leftovers"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
