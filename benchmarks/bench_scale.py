"""Quantizing a 1B-class model under a RAM cap below the model's size: time per block, total time, peak RSS.

1. Builds once (cached under ``--workdir``) a random-weight model with Llama-3.2-1B's shapes (hidden 2048, 16
   layers, 32 heads / 8 kv heads, intermediate 8192, vocab 128256, tied embeddings, rope theta 500000; 2.47 GB in
   bf16) as a sharded HF directory (``--shard-mb``, default 500: five shards and an index), through
   ``tools/random_model.py``. Tokenizer: SmolLM2's (49,152 tokens, from quantkit's converted ``smollm2-135m``)
   where the model's vocabulary holds it, so calibration tokenizes real text; the embedding keeps all 128,256
   rows (the ids it never sees cost memory all the same). Smaller presets get a built word-level tokenizer.
2. Runs ``quantkit quantize`` in a subprocess per method (default RTN and GPTQ, W4 g64 symmetric, 16 x 512
   calibration windows of the shipped corpus) under a cap of ``--cap-fraction`` (default 0.6) of the model's
   bf16 size, enforced as ``tools/memory_cap.py`` says (a child memory cgroup where writable, else an RSS
   watchdog). Block times come from the work directory: each finished block's file appears in ``OUT.partial/``.
3. Checks each checkpoint loads: quantkit's loader and transformers (compressed-tensors) both give finite logits
   on a short prompt, and how far apart they are.

Mixture of experts: ``--preset qwen3-30b-a3b-e16`` builds a ``qwen3_moe`` model with Qwen3-30B-A3B's per-layer
shapes, 16 experts per layer instead of 128 and 12 layers instead of 48 (1.76B parameters, 3510 MB in bf16, cap
2106 MB; why 16 experts: ``tools/random_model.py``), its experts stored one tensor per projection as transformers
writes them. Recorded with 8 x 512 calibration windows (``--num-samples 8``, for time): every expert sees every
token (quantkit's default ``--moe-calibration all``), so a block's calibration work grows with its expert count.
quantkit's loader (:func:`quantkit.model.resolve.load_model`, which unfuses the experts) must give finite logits;
should transformers' compressed-tensors loader fail on per-expert quantized experts, that is recorded as "not
loadable in transformers" (its error in the JSON), not a crash.

Prints a rich table; ``--json OUT`` writes every figure; ``--record NAME`` writes the docs table
``benchmarks/results/NAME.json`` (``python -m benchmarks.render`` puts it in docs/benchmarks.md). Sizes in MB are
10^6 bytes. ``--layers N`` keeps the preset's width with N decoder layers (a quick look at one block's memory).

    python -m benchmarks.bench_scale --json /work/tmp/scale/bench_scale.json
    python -m benchmarks.bench_scale --preset tiny --workdir /tmp/scale-tiny --num-samples 4 --seq-len 64  # smoke
    python -m benchmarks.bench_scale --preset qwen3-30b-a3b-e16 --num-samples 8 --record scale_moe
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from tools.memory_cap import CappedRun, run_capped
from tools.random_model import BUILD_RECORD, PRESETS, Shape, build_random_model, parameter_count

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
DEFAULT_WORKDIR = Path("/work/tmp/scale")
SMOLLM2 = "smollm2-135m"


def preset_shape(preset: str, layers: int | None) -> Shape:
    return PRESETS[preset] if layers is None else replace(PRESETS[preset], layers=layers)


def model_dir(workdir: Path, preset: str, shard_mb: int, layers: int | None = None) -> Path:
    """The random model (built on first use), with SmolLM2's tokenizer where the vocabulary holds it."""
    tokenizer = None
    if PRESETS[preset].vocab >= PRESETS[SMOLLM2].vocab:
        from quantkit.model.resolve import resolve_model

        tokenizer = resolve_model(SMOLLM2)
    name = f"model-{preset}" if layers is None else f"model-{preset}-{layers}l"  # each depth keeps its own build
    return build_random_model(workdir / name, preset, shard_mb=shard_mb, tokenizer=tokenizer, layers=layers)


class BlockClock:
    """Times at which each block's file appears in ``OUT.partial/`` (its mtime: when it was written)."""

    def __init__(self, output: Path, poll_s: float = 0.1) -> None:
        self.partial = output.with_name(output.name + ".partial")
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), daemon=True)

    def __enter__(self) -> BlockClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                for f in self.partial.glob("block_*.safetensors"):  # a file left by an earlier run is replaced
                    self.seen[f.name] = max(self.seen.get(f.name, 0.0), f.stat().st_mtime)
            except OSError:
                continue

    def block_seconds(self, started: float) -> list[float]:
        """Seconds per block; the first is counted from the start of the run (so it includes the setup)."""
        times = [started, *sorted(t for t in self.seen.values() if t >= started)]
        return [b - a for a, b in itertools.pairwise(times)]


def quantize_under_cap(model: Path, out: Path, method: str, cap: int, args: argparse.Namespace) -> dict:
    """One ``quantkit quantize`` run under the cap; its figures."""
    report = out.with_name(out.name + ".json")  # not with_suffix: "llama3.2-1b" has a dot
    log = out.with_name(out.name + ".log")
    command = [sys.executable, "-m", "quantkit", "quantize", str(model), "-o", str(out), "--force"]
    command += ["--method", method, "--bits", "4", "--group-size", str(args.group_size), "--json", str(report)]
    command += ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--device", "cpu"]
    report.unlink(missing_ok=True)
    load_before = os.getloadavg()  # the machine's load around the run: other jobs share its cores
    with log.open("w") as sink, BlockClock(out) as clock:
        started = time.time()
        run: CappedRun = run_capped(command, cap, on_line=lambda line: print(line, file=sink, flush=True))
    result = json.loads(report.read_text()) if report.is_file() and run.returncode == 0 else {}
    blocks = clock.block_seconds(started)
    figures = {
        "method": method,
        "ok": run.returncode == 0,
        "returncode": run.returncode,
        "killed_over_cap": run.killed_over_cap,
        "enforcement": run.enforcement,
        "cap_mb": cap / 1e6,
        "wall_s": run.seconds,
        "quantize_seconds": result.get("seconds"),
        "block_seconds": blocks,
        # polled VmHWM, or quantkit's own reading at the end of the work when that is higher
        "peak_rss_mb": max(run.peak_rss_bytes / 1e6, result.get("peak_rss_mb") or 0.0),
        "peak_anon_mb": run.peak_anon_bytes / 1e6,
        "cgroup_peak_mb": None if run.cgroup_peak_bytes is None else run.cgroup_peak_bytes / 1e6,
        "checkpoint_mb": result.get("checkpoint_bytes", 0) / 1e6,
        "log": str(log),
        "load_average_before": load_before,  # 1, 5 and 15 minutes
        "load_average_after": os.getloadavg(),
    }
    if not figures["ok"]:
        figures["log_tail"] = log.read_text().splitlines()[-15:]
    return figures


def check_load(checkpoint: Path) -> dict:
    """Both loaders on a short prompt: finite logits, and the largest difference between them. quantkit's is
    :func:`~quantkit.model.resolve.load_model` (which unfuses a mixture of experts' per-expert tensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.model.resolve import load_model

    ids = AutoTokenizer.from_pretrained(checkpoint)(PROMPT, return_tensors="pt").input_ids
    figures: dict[str, object] = {"prompt_tokens": int(ids.shape[1])}
    logits = {}
    for name, load in (
        ("quantkit", lambda: load_model(checkpoint)),
        ("transformers", lambda: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)),
    ):
        try:
            model = load().eval()
            with torch.inference_mode():
                logits[name] = model(ids).logits.float()
            figures[f"{name}_finite"] = bool(torch.isfinite(logits[name]).all())
            del model
        except Exception as exc:  # a loader that fails is a finding to report, not a crash of the benchmark
            figures[f"{name}_finite"] = False
            figures[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    if len(logits) == 2:
        figures["max_abs_logit_diff"] = float((logits["quantkit"] - logits["transformers"]).abs().max())
    return figures


def render(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    model = summary["model"]
    title = (
        f"{model['preset']}-shape random model ({model['parameters'] / 1e9:.2f}B parameters, "
        f"{model['bf16_mb']:.0f} MB in bf16, {model['shards']} shards); cap {summary['cap_mb']:.0f} MB "
        f"({summary['cap_fraction']:.0%}, {summary['runs'][0]['enforcement'] if summary['runs'] else '-'})"
    )
    table = Table(title=title, title_justify="left")
    columns = ("method", "status", "total s", "s/block", "peak RSS MB", "of model", "anon MB", "cgroup MB", "out MB")
    for column in (*columns, "loads", "max|dlogit|"):
        table.add_column(column, justify="left" if column in ("method", "status", "loads") else "right")
    for run in summary["runs"]:
        blocks = run["block_seconds"][1:] or run["block_seconds"]  # the first also holds the start-up
        load = run.get("load", {})
        loads = "+".join(n[:2] for n in ("quantkit", "transformers") if load.get(f"{n}_finite")) or "no"
        if load.get("transformers_error"):
            loads += " (tr: error)"
        status = "ok" if run["ok"] else ("KILLED (cap)" if run["killed_over_cap"] else f"rc {run['returncode']}")
        diff = load.get("max_abs_logit_diff")
        table.add_row(
            run["method"],
            status,
            f"{run['wall_s']:.0f}",
            f"{statistics.median(blocks):.1f}" if blocks else "-",
            f"{run['peak_rss_mb']:.0f}",
            f"{run['peak_rss_mb'] / model['bf16_mb']:.0%}",
            f"{run['peak_anon_mb']:.0f}",
            "-" if run["cgroup_peak_mb"] is None else f"{run['cgroup_peak_mb']:.0f}",
            f"{run['checkpoint_mb']:.0f}",
            loads,
            "-" if diff is None else f"{diff:.1e}",
        )
    console = Console()
    console.print(table)
    console.print(
        "s/block: median from the second block on. peak RSS: VmHWM (mapped shard pages included; pages another "
        "process brought into the page cache are charged to it, not to the cap). anon: the largest RssAnon polled, "
        "memory the process holds itself. cgroup: resident memory plus page cache charged to the capped group at "
        "its peak (the kernel reclaims cache before it kills). loads: qu(antkit) and tr(ansformers) give finite "
        "logits; max|dlogit| between them."
    )
    for run in summary["runs"]:
        for name in ("quantkit", "transformers"):
            if error := run.get("load", {}).get(f"{name}_error"):
                console.print(f"{run['method']}: not loadable in {name}: {error[:500]}", markup=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="model cache and outputs")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--methods", nargs="+", default=["rtn", "gptq"])
    parser.add_argument("--cap-fraction", type=float, default=0.6, help="cap as a fraction of the bf16 model size")
    parser.add_argument("--cap-mb", type=float, help="the cap in MB instead (e.g. for a tiny preset)")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--shard-mb", type=int, default=500, help="largest shard of the random model, MB")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--no-load-check", action="store_true")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--record", help="record the docs table as benchmarks/results/NAME.json")
    args = parser.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("QUANTKIT_CACHE", str(args.workdir / "cache"))  # shard hashes; the children inherit it
    model = model_dir(args.workdir, args.preset, args.shard_mb, args.layers)
    shape = preset_shape(args.preset, args.layers)
    params = parameter_count(shape)
    cap = int(args.cap_mb * 1e6) if args.cap_mb else int(args.cap_fraction * params * 2)
    summary: dict = {
        "command": " ".join(["python -m benchmarks.bench_scale", *(sys.argv[1:] if argv is None else argv)]),
        "shard_mb": args.shard_mb,
        "model": {
            "preset": args.preset,
            "layers": shape.layers,
            "path": str(model),
            "parameters": params,
            "bf16_mb": params * 2 / 1e6,
            "shards": len(list(model.glob("*.safetensors"))),
            "tokenizer": json.loads((model / BUILD_RECORD).read_text())["tokenizer"],
        },
        "cap_fraction": cap / (params * 2),
        "cap_mb": cap / 1e6,
        "calibration": f"{args.num_samples} x {args.seq_len}",
        "scheme": f"W4 g{args.group_size} sym",
        "cpu_threads": os.cpu_count(),
        "runs": [],
    }
    for method in args.methods:
        out = args.workdir / f"{model.name.replace('model-', 'out-', 1)}-{method}"
        run = quantize_under_cap(model, out, method, cap, args)
        if run["ok"] and not args.no_load_check:
            run["load"] = check_load(out)
        summary["runs"].append(run)
        print(f"{method}: {'ok' if run['ok'] else 'FAILED'} in {run['wall_s']:.0f} s", flush=True)
    render(summary)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if args.record:
        from benchmarks.scale_record import record

        print(f"recorded {record(args.record, summary, shape, args.shard_mb)}")
    return 0 if all(r["ok"] for r in summary["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
