"""Tables of a GPU check's figures (tools/gpu_check.sh on a lent GPU machine), recorded from the files that run
brought back (kept under ``benchmarks/gpu/<machine>-<date>/``):

- ``gpu_kernels``: the Triton kernels on 7B shapes, each timed two ways in one run of benchmarks/bench_kernels.py:
  host-launched (CUDA events around each call) and inside a CUDA graph (``--graph``: the kernel's own time);
- ``gpu_check``: the issue's goals (kernel tests, parity with transformers, ``quantize --device cuda``), each with
  its figure and verdict.

    python -m benchmarks.gpu_record benchmarks/gpu/h100-2026-11-27 --date 2026-11-27
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.record import record_table

MATMUL_GOAL = (3.0, 0.70)  # at decode rows (M <= 16): speed-up over torch fp16, and share of the copy bandwidth
ATTENTION_GOAL = 0.60  # paged attention at context 4096, batch 16: share of the copy bandwidth
GPTQ_GOAL_S = 15 * 60  # GPTQ W4 g128 of a 7B model's 32 blocks with --device cuda


def _load(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        raise SystemExit(f"{path}: missing; a GPU check's folder holds check.json, kernels_graph.json, ...")
    return json.loads(path.read_text())


def machine_of(check: dict[str, Any]) -> str:
    env = check["steps"]["env"]["result"]["env"]["figures"]
    return (
        f"machine with one {env['device']} ({env['cpus']}-core host), torch {env['torch']} (CUDA {env['torch_cuda']}), "
        f"triton {env['triton']}"
    )


def kernel_rows(graph: dict[str, Any], events: dict[str, Any]) -> list[list[str]]:
    """One row per kernel and shape: both timings, the graph's ratio and bandwidth share, the goal's verdict."""
    by_key = {(r["kernel"], r["shape"], r["m"]): r for r in events["rows"]}
    rows = []
    for r in graph["rows"]:
        host = by_key.get((r["kernel"], r["shape"], r["m"]))
        goal, verdict = "-", "-"
        if r["kernel"] == "quant_matmul" and r["m"] <= 16:
            speed, share = MATMUL_GOAL
            goal = f">= {speed:.0f}x torch, >= {share:.0%} of bw"
            verdict = "met" if r["speedup"] >= speed and r["bandwidth_fraction"] >= share else "missed"
        elif r["kernel"] == "paged_attention" and r["m"] == 16:
            goal = f">= {ATTENTION_GOAL:.0%} of bw"
            verdict = "met" if r["bandwidth_fraction"] >= ATTENTION_GOAL else "missed"
        rows.append(
            [
                r["kernel"],
                r["shape"].removeprefix("llama7b "),
                str(r["m"]),
                f"{1e3 * host['triton_ms']:.1f}" if host else "-",
                f"{1e3 * r['triton_ms']:.1f}",
                f"{1e3 * r['torch_ms']:.1f}",
                f"{r['speedup']:.2f}x",
                f"{r['bandwidth_fraction']:.0%}",
                goal,
                verdict,
            ]
        )
    return rows


def check_rows(check: dict[str, Any], gptq: dict[str, Any]) -> list[list[str]]:
    """The goals of the check that are not kernel timings, each with its figure."""
    steps = check["steps"]
    kernels = steps["kernels"]["result"]["kernels"]
    parity = steps["parity"]["result"]["parity"]["figures"]
    engines = steps["smoke"]["result"]["engines"]["figures"]
    g = gptq["steps"]["gptq8"]["result"]["gptq"]["figures"]
    decode = steps["decode7b"]
    return [
        [
            "kernel tests on the GPU (tests/runtime/kernels, fp16, bf16, fp32)",
            f"{kernels['passed']} passed, {kernels['failures'] + kernels['errors']} failed",
            "all pass",
            "met" if kernels["failures"] + kernels["errors"] == 0 and kernels["passed"] > 0 else "missed",
        ],
        [
            "kernel self-check at engine start",
            f"{engines['selfcheck']}; auto backend {engines['auto_backend']}",
            "all pass",
            "met" if engines["selfcheck"] == "all pass" else "missed",
        ],
        [
            "engine, Triton vs torch backend (W4 135M-shape model, bf16)",
            f"logits rel. err {engines['logits_rel_err']:.3f}, argmax agree {engines['argmax_agree']:.3f}, "
            f"unexplained divergences {engines['unexplained_divergences']}",
            "no unexplained divergence",
            "met" if engines["unexplained_divergences"] == 0 else "missed",
        ],
        [
            "engine (Triton, fp16) vs transformers, float 135M-shape model",
            f"logits rel. err {parity['logits_rel_err']:.4f}, argmax agree {parity['argmax_agree']:.3f}, "
            f"unexplained divergences {parity['unexplained_divergences']}",
            "no unexplained divergence",
            "met" if parity["unexplained_divergences"] == 0 else "missed",
        ],
        [
            f"GPTQ W4 g128 --device cuda, {g['layers']} blocks of 7B width ({g['windows']} windows)",
            f"{g['s_per_block']:.1f} s per block; 32 blocks ~{g['estimate_32_layers_s']:.0f} s; "
            f"peak GPU {g['peak_gpu_mb']:.0f} MB",
            f"32 blocks < {GPTQ_GOAL_S // 60} min",
            "met" if g["estimate_32_layers_s"] < GPTQ_GOAL_S else "missed",
        ],
        [
            "engine decode of the 7B-shape W4 model, batch 1",
            "not measured" if decode["status"] != "ok" else json.dumps(decode["result"])[:80],
            ">= 50% of the roofline",
            "not measured" if decode["status"] != "ok" else "see notes",
        ],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a GPU check's files: check.json, check_gptq8.json, kernels_*.json")
    parser.add_argument("--date", required=True, help="the day the check ran (YYYY-MM-DD)")
    parser.add_argument("--note", action="append", default=[], help="a note under the goals table (repeatable)")
    args = parser.parse_args(argv)
    check, gptq = _load(args.folder, "check.json"), _load(args.folder, "check_gptq8.json")
    graph, events = _load(args.folder, "kernels_graph.json"), _load(args.folder, "kernels_events.json")
    machine = machine_of(check)
    command = f"python -m benchmarks.gpu_record {args.folder} --date {args.date}"
    record_table(
        "gpu_kernels",
        title="GPU: the Triton kernels on 7B shapes, host-launched and inside a CUDA graph",
        order=65,
        protocol=(
            "benchmarks/bench_kernels.py --models llama7b --kernels matmul attention --batches 1 16 --prefill 256 "
            "--context 4096 --bits 4 --group-size 128, run twice in one call: with CUDA events around each call "
            "(what a host-launched engine step pays, launch included) and with --graph (10 calls captured in one "
            "CUDA graph, the L2 flushes subtracted: the kernel's own time); the L2 cache flushed before every call; "
            "% of bw: bytes moved over the measured device-to-device copy bandwidth "
            f"({graph['copy_bandwidth_gb_s']:.0f} GB/s), from the graph time."
        ),
        baseline="torch fp16 dense x @ W^T (matmul), SDPA on pre-gathered K/V (attention), also inside the graph",
        columns=[
            "kernel",
            "shape",
            "M / batch",
            "triton µs (events)",
            "triton µs (graph)",
            "torch µs (graph)",
            "torch/triton (graph)",
            "% of bw (graph)",
            "goal",
            "verdict",
        ],
        rows=kernel_rows(graph, events),
        notes=[
            "The events column includes the host's launch cost: the W4 matmul spends more time being launched than "
            "running, so an engine step gains most from CUDA graphs. Inside a graph the W4 matmul is still far from "
            "its goal at decode rows, and slower than torch's fp16 matmul at 256 rows.",
        ],
        command=command,
        machine_name=machine,
        measured=args.date,
    )
    record_table(
        "gpu_check",
        title="GPU: quantkit on a lent GPU (the GPU check's goals)",
        order=66,
        protocol=(
            "bash tools/gpu_check.sh --budget 450 (one call: env, install, smoke, kernels, bench, parity, build7b, "
            "rtn7b, decode7b, gptq8), then install gptq8 in a second call on the same machine; random models of "
            "SmolLM2-135M's and Llama-2-7B's shapes drawn on the GPU."
        ),
        baseline="the goal in each row",
        columns=["check", "figure", "goal", "verdict"],
        rows=check_rows(check, gptq),
        notes=args.note,
        command=command,
        machine_name=machine,
        measured=args.date,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
