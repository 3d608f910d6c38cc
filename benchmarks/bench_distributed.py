"""Quantizing on several processes (``torchrun``): what a failure costs, and what speed-up to expect.

``kill``: kill-one-rank trials on a tiny random Llama (tools/random_model.py ``tiny``, 4 layers, float32; 16 x 32
windows of the shipped corpus, mini-batches of 2; W4 g32 GPTQ). Each trial runs ``torchrun --nproc-per-node 2`` on
the CPU (gloo, one thread per process) with ``QUANTKIT_DIST_FAULT=<rank>:<block>:kill`` (a random rank and block:
the process ends as ``kill -9`` ends it), measures the time from the kill to the end of the launcher (every rank
stopped), then ``--resume`` with 1 and 2 processes in turn, and compares the checkpoint with an uninterrupted
one-process run byte for byte.

``model``: a cost model of one decoder block on N ranks, from config shapes (Llama-2-7B: hidden 4096, 32 heads,
intermediate 11008; Qwen3-30B-A3B: hidden 2048, 32 / 4 heads of 128, 128 experts of intermediate 768, top-8, every
token through every expert for the statistics, quantkit's default). What quantkit does on N ranks:

    T_N = F / N + sum over stages of (the busiest rank's solves) + C_N + W
    F   = the calibration forward and the per-batch Gram matrices (windows split over the ranks, perfectly)
    solves: a stage's runs (a dense stage has one; an MoE gate/up stage 24 of <= 8192 rows) spread by cost (LPT);
          each MoE expert's down stage has its own Hessian and one run, solved by one rank, one after the other
    C_N = Hessian partials to the solving rank (<= 2 log2(chunks per rank) partials of K x K float32 per other
          rank) + the solved weights broadcast (codes, scales) + every rank's block output gathered on rank 0
          (to save it for --resume), each bytes / link bandwidth + a latency per message
    W   = rank 0 writing the block (the same for every N; taken as 0 here)

Rates: GEMM throughput for F, and the GPTQ solve as ``a K^3 + b rows K^2`` seconds. Defaults are stated
assumptions for one H100 per rank (``--gemm-tflops 40``: float32 products as quantkit runs them; ``--solve-tflops
8``: the column sweep is latency bound; ``--link-gbps 100``: NCCL point to point inside a node; 25 across nodes).
``--measure`` times a Gram product and a GPTQ solve on this machine's device instead (run it alone: two jobs on
two cores slow each other 5-7x). On one GPU, N processes sharing it give the overhead, not the speed-up.

    python -m benchmarks.bench_distributed kill --trials 5 --json /work/tmp/dist/kill.json
    python -m benchmarks.bench_distributed model --json /work/tmp/dist/model.json
    python -m benchmarks.bench_distributed model --measure   # rates from this machine (alone on it)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quantkit.distributed.plan import assign, makespan
from quantkit.distributed.reduce import chunk_ranges, chunks_of, cover
from quantkit.quantization.quantize_block import MAX_STACKED_EXPERT_ROWS
from tools.random_model import PRESETS, Experts, Shape, build_random_model

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "calibration" / "austen_persuasion_eval.txt"
SHAPES = {
    "llama2-7b": PRESETS["llama2-7b"],
    "qwen3-30b-a3b": replace(PRESETS["qwen3-30b-a3b-e16"], layers=48, experts=Experts(128, 8, 768)),
}
console = Console()


# ------------------------------------------------------------------------------------------------ kill trials


def _quantize(model: Path, out: Path, procs: int, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    args = ["quantize", str(model), "-o", str(out), "--dataset", str(CORPUS), "--num-samples", "16"]
    args += ["--seq-len", "32", "--batch-size", "2", "--group-size", "32", *extra]
    launcher = [sys.executable, "-m", "quantkit"]
    if procs > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", "-m"]
        launcher.append("quantkit")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTKIT_DIST_FAULT")}
    run_env |= {"OMP_NUM_THREADS": "1"} | (env or {})
    done = subprocess.run([*launcher, *args], env=run_env, capture_output=True, text=True, timeout=900, check=False)
    return done.returncode, done.stderr


def kill_trials(workdir: Path, trials: int, seed: int, layers: int = 4) -> dict:
    model = build_random_model(workdir / "model", "tiny", dtype="float32", layers=layers)
    reference = workdir / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    code, err = _quantize(model, reference, 1)
    assert code == 0, err
    expected = (reference / "model.safetensors").read_bytes()
    rng = random.Random(seed)
    rows = []
    for trial in range(trials):
        rank, block, resume_procs = rng.randrange(2), rng.randrange(layers), 1 + trial % 2
        out, stamp = workdir / f"trial{trial}", workdir / f"trial{trial}.killed-at"
        for path in (out, out.with_name(out.name + ".partial")):
            shutil.rmtree(path, ignore_errors=True)
        env = {"QUANTKIT_DIST_FAULT": f"{rank}:{block}:kill", "QUANTKIT_DIST_FAULT_STAMP": str(stamp)}
        code, err = _quantize(model, out, 2, env=env)
        stopped = time.time()
        stop_s = stopped - float(stamp.read_text())
        finished = json.loads((out.with_name(out.name + ".partial") / "state.json").read_text())["finished"]
        resumed, resume_err = _quantize(model, out, resume_procs, "--resume")
        same = resumed == 0 and (out / "model.safetensors").read_bytes() == expected
        rows.append(
            {"trial": trial, "rank": rank, "block": block, "exit": code, "stop_s": round(stop_s, 2),
             "blocks_saved": finished, "resume_processes": resume_procs, "same_bytes": same,
             "resume_error": "" if resumed == 0 else resume_err.strip().splitlines()[-1:]}
        )  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
    return {"model": "tiny random Llama, 4 layers, float32", "windows": "16 x 32, batch 2", "trials": rows}


# ------------------------------------------------------------------------------------------------ cost model


@dataclass(frozen=True)
class Rates:
    gemm_tflops: float  # float32 products (forward and Gram)
    solve_tflops: float  # GPTQ's factorisation and column sweep, effective
    link_gbps: float  # bytes per second between two ranks, in GB/s
    latency_s: float = 30e-6  # per message
    source: str = "assumed"


@dataclass(frozen=True)
class StageShape:
    name: str
    k: int  # in-features (the Hessian is k x k)
    runs: tuple[int, ...]  # rows of each solve of the stage
    forward_flops_per_token: float  # what computing the stage's inputs costs, per calibration token


def stages(shape: Shape, seq_len: int) -> list[StageShape]:
    h, d = shape.hidden, shape.attention_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    attention = 4.0 * seq_len * q / 2  # scores and values, causal: half the window on average
    out = [
        StageShape("qkv", h, (q + 2 * kv,), 0.0),
        StageShape("o", q, (h,), 2.0 * h * (q + 2 * kv) + attention),
    ]
    if shape.experts is None:
        i = shape.intermediate
        return [*out, StageShape("gate_up", h, (2 * i,), 2.0 * q * h), StageShape("down", i, (h,), 4.0 * h * i)]
    e, i = shape.experts.count, shape.experts.intermediate
    rows, chunk = [], MAX_STACKED_EXPERT_ROWS // (2 * i) * (2 * i)
    for start in range(0, e * 2 * i, chunk):
        rows.append(min(chunk, e * 2 * i - start))
    out.append(StageShape("experts gate_up", h, tuple(rows), 2.0 * q * h + 2.0 * h * e))
    out += [StageShape(f"expert {x} down", i, (h,), 4.0 * h * i) for x in range(e)]
    return out


def solve_seconds(k: int, rows: int, rates: Rates) -> float:
    """GPTQ on ``rows`` x ``k``: the Cholesky factor and inverse (~4/3 k^3) and the column sweep (~2 rows k^2)."""
    return (4.0 / 3.0 * k**3 + 2.0 * rows * k**2) / (rates.solve_tflops * 1e12)


def block_time(shape: Shape, ranks: int, windows: int, seq_len: int, batch: int, rates: Rates) -> dict:
    tokens = windows * seq_len
    chunks = chunks_of(-(-windows // batch))  # the Hessians' summation tree is over chunks of mini-batches
    ranges = chunk_ranges(chunks, ranks)
    forward = gram = solves = hessian_bytes = weight_bytes = messages = 0.0
    for stage in stages(shape, seq_len):
        forward += stage.forward_flops_per_token * tokens / (rates.gemm_tflops * 1e12) / ranks
        gram += tokens * stage.k**2 / (rates.gemm_tflops * 1e12) / ranks  # the upper triangle: k^2 mult-adds/token
        costs = [rows * stage.k for rows in stage.runs]
        owners = assign(costs, ranks)
        loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(ranks)]
        busiest = loads.index(max(loads))
        solves += sum(solve_seconds(stage.k, r, rates) for r, o in zip(stage.runs, owners, strict=True) if o == busiest)
        assert makespan(costs, owners, ranks) >= max(costs)
        if ranks > 1:
            holders = set(owners)
            partials = max(len(cover(a, b, chunks)) for a, b in ranges)
            # the busiest link: a holder receives every other rank's partials, or a sender sends to every holder
            hessian_bytes += max(partials * (ranks - 1), partials * len(holders)) * stage.k**2 * 4
            weight_bytes += sum(rows * stage.k * 1.25 for rows in stage.runs)  # int8 codes + g64 float32 scales
            messages += partials * (ranks - 1) + len(stage.runs) * math.ceil(math.log2(ranks))
    gather_bytes = tokens * shape.hidden * 2 * (ranks - 1) / ranks if ranks > 1 else 0.0  # bf16 rows to rank 0
    link = rates.link_gbps * 1e9
    comm = (hessian_bytes + weight_bytes + gather_bytes) / link + messages * rates.latency_s
    total = forward + gram + solves + comm
    return {
        "ranks": ranks, "forward_s": forward, "gram_s": gram, "solve_s": solves, "comm_s": comm,
        "hessian_MB": hessian_bytes / 1e6, "weights_MB": weight_bytes / 1e6, "gather_MB": gather_bytes / 1e6,
        "block_s": total,
    }  # fmt: skip


def measure_rates(link_gbps: float) -> Rates:
    """A float32 Gram product and a GPTQ solve, timed on this machine's device (run alone)."""
    import torch

    from quantkit.format.scheme import QuantScheme
    from quantkit.quantization.methods.gptq import GPTQConfig
    from quantkit.quantization.solvers.gptq import gptq_solve

    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, rows, tokens = (4096, 4096, 8192) if device == "cuda" else (1024, 1024, 2048)
    x = torch.randn(tokens, k, device=device)
    gram = torch.zeros(k, k, device=device)
    gram.addmm_(x.T, x)  # warm-up
    start = time.perf_counter()
    for _ in range(3):
        gram.addmm_(x.T, x)
    if device == "cuda":
        torch.cuda.synchronize()
    gemm = 3 * 2.0 * tokens * k * k / (time.perf_counter() - start) / 1e12
    h = (gram / (4 * tokens) + torch.eye(k, device=device)).float()
    w = torch.randn(rows, k, device=device)
    scheme = QuantScheme(bits=4, group_size=64, act_order=True, static_groups=True, mse_clip=True)
    start = time.perf_counter()
    gptq_solve(w, h, scheme, GPTQConfig())
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    solve = (4.0 / 3.0 * k**3 + 2.0 * rows * k**2) / elapsed / 1e12
    return Rates(gemm, solve, link_gbps, source=f"measured on {device} (K={k}, rows={rows})")


def cost_model(rates: Rates, windows: int, seq_len: int, batch: int, world: list[int]) -> dict:
    out = {"rates": asdict(rates), "windows": windows, "seq_len": seq_len, "batch_size": batch, "shapes": {}}
    for name, shape in SHAPES.items():
        rows = [block_time(shape, n, windows, seq_len, batch, rates) for n in world]
        for row in rows:
            row["speedup"] = rows[0]["block_s"] / row["block_s"]
        out["shapes"][name] = {"layers": shape.layers, "blocks": rows}
    return out


def render_model(result: dict) -> None:
    for name, shape in result["shapes"].items():
        table = Table(title=f"{name}: one block ({result['rates']['source']} rates)", title_justify="left")
        for column in ("ranks", "forward+Gram s", "solves s", "comm s", "Hessian MB", "block s", "model s", "speed-up"):
            table.add_column(column, justify="right")
        for b in shape["blocks"]:
            table.add_row(
                str(b["ranks"]), f"{b['forward_s'] + b['gram_s']:.2f}", f"{b['solve_s']:.2f}", f"{b['comm_s']:.3f}",
                f"{b['hessian_MB']:.0f}", f"{b['block_s']:.2f}", f"{b['block_s'] * shape['layers']:.0f}",
                f"{b['speedup']:.2f}x",
            )  # fmt: skip
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    kill = sub.add_parser("kill", help="kill-one-rank trials on a tiny model (CPU, gloo)")
    kill.add_argument("--trials", type=int, default=5)
    kill.add_argument("--seed", type=int, default=0)
    kill.add_argument("--workdir", type=Path)
    kill.add_argument("--json", type=Path)
    model = sub.add_parser("model", help="predicted speed-up at 2/4/8 ranks for 7B and 30B-A3B shapes")
    model.add_argument("--measure", action="store_true", help="time the rates on this machine (run it alone)")
    model.add_argument("--gemm-tflops", type=float, default=40.0)
    model.add_argument("--solve-tflops", type=float, default=8.0)
    model.add_argument("--link-gbps", type=float, default=100.0)
    model.add_argument("--windows", type=int, default=128)
    model.add_argument("--seq-len", type=int, default=2048)
    model.add_argument("--batch-size", type=int, default=4)
    model.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.mode == "kill":
        with tempfile.TemporaryDirectory(prefix="qk-dist-") as tmp:
            result = kill_trials(args.workdir or Path(tmp), args.trials, args.seed)
        table = Table(title="kill one rank of 2, then --resume", title_justify="left")
        for column in ("trial", "rank", "block", "stop s", "blocks saved", "resumed on", "same bytes"):
            table.add_column(column, justify="right")
        for t in result["trials"]:
            table.add_row(*map(str, (t["trial"], t["rank"], t["block"], t["stop_s"], t["blocks_saved"],
                                     t["resume_processes"], t["same_bytes"])))  # fmt: skip
        console.print(table)
    else:
        rates = measure_rates(args.link_gbps) if args.measure else Rates(args.gemm_tflops, args.solve_tflops,
                                                                         args.link_gbps)  # fmt: skip
        result = cost_model(rates, args.windows, args.seq_len, args.batch_size, [1, 2, 4, 8])
        render_model(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
