"""Kernel timings on the GPU: the figures of a benchmarks/bench_kernels.py run, and a block-size sweep of the W4 matmul.

``sweep``: the Llama-2-7B gate/up projection (K 4096, N 11008, W4 g128) at one M per tile bucket of
``default_config`` (1 and 16: decode, split-K; 64; 256: prefill), a few tile shapes each against the default, timed
with bench_kernels' CUDA-event timer (L2 flushed before every call). Each candidate's output is checked against the
default's; a candidate that fails to compile or to run is recorded with its error. GPU only.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from tools.gpu_check_common import seconds_left, write

K, N, GROUP = 4096, 11008, 128
BUCKETS = (1, 16, 64, 256)
TILES = {  # (block_m, block_n, block_k, num_warps) per bucket, besides the default
    "decode": [(16, 32, 128, 4), (16, 128, 128, 4), (16, 64, 64, 4), (16, 128, 64, 4)],
    "mid": [(32, 128, 64, 4), (64, 64, 128, 4), (64, 128, 128, 4), (64, 256, 64, 8)],
    "prefill": [(128, 256, 64, 8), (64, 128, 128, 4), (128, 128, 128, 8), (64, 256, 64, 4)],
}


def split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, sms: int) -> int:
    """The launcher's rule (quant_matmul.default_config): decode rows split K until there are ~2 programs per SM."""
    if m > 16:
        return 1
    tiles = math.ceil(n / block_n) * math.ceil(m / block_m)
    return max(1, min(max(1, 2 * sms // tiles), math.ceil(k / block_k), 16))


def candidates(m: int, sms: int) -> list:
    """The default configuration first, then the bucket's other tiles (and, for decode, half and twice its split)."""
    import torch

    from quantkit.runtime.kernels.quant_matmul import QuantMatmulConfig, default_config

    default = default_config(m, N, K, 4, GROUP, False, torch.device("cuda"))
    bucket = "decode" if m <= 16 else ("mid" if m <= 64 else "prefill")
    found = [default]
    for bm, bn, bk, warps in TILES[bucket]:
        found.append(QuantMatmulConfig(bm, bn, bk, split_k(m, N, K, bm, bn, bk, sms), warps, default.num_stages))
    if bucket == "decode":
        found += [replace(default, split_k=max(1, default.split_k // 2)), replace(default, split_k=default.split_k * 2)]
    unique: list = []
    for cfg in found:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def time_bucket(m: int, x, weight: dict, configs: list, timer: Callable, bound_ms: float, stop: float) -> dict:
    """Each configuration's time (``timer(fn)``: ms) and its output's error against the first that ran; the best
    one that computes the same function as a figure. Stops at ``stop`` (epoch seconds)."""
    from quantkit.runtime.kernels.quant_matmul import quant_matmul

    reference = None
    rows: list[dict] = []
    stopped = False
    for cfg in configs:
        if time.time() > stop:
            stopped = True
            break
        row: dict = {"config": asdict(cfg)}
        try:
            y = quant_matmul(x, **weight, bits=4, group_size=GROUP, config=cfg)
            reference = y if reference is None else reference
            row["rel_err_vs_default"] = float((y - reference).abs().max() / reference.abs().max())
            row["us"] = 1e3 * timer(lambda cfg=cfg: quant_matmul(x, **weight, bits=4, group_size=GROUP, config=cfg))
            row["of_bandwidth"] = bound_ms / (row["us"] / 1e3)
        except Exception as exc:  # an out-of-resources tile or a compile error: recorded, the sweep goes on
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            row["error"] = f"{type(exc).__name__}: {first}"
        rows.append(row)
    figures: dict = {}
    timed = [r for r in rows if "us" in r and r["rel_err_vs_default"] < 1e-2]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        c = best["config"]
        tile = f"{c['block_m']}x{c['block_n']}x{c['block_k']} split {c['split_k']} w{c['num_warps']}"
        figures[f"m{m}_default_us"] = round(rows[0].get("us", float("nan")), 1)
        figures[f"m{m}_best"] = f"{best['us']:.1f}us {tile} ({100 * best['of_bandwidth']:.0f}% of bw)"
    if stopped:
        figures["stopped"] = f"at m={m}: out of time"
    return {"m": m, "bound_us": 1e3 * bound_ms, "rows": rows, "figures": figures}


def sweep(out: Path, seconds: float) -> None:
    """Stops after ``seconds`` (or near the step's deadline) with what it measured so far."""
    import torch

    if not torch.cuda.is_available():
        write(out, {"figures": {"sweep": "skipped: no CUDA"}})
        return
    from benchmarks.bench_kernels import Timer, copy_bandwidth, make_quant_weight

    timer = Timer(warmup=5, reps=20, flush=True)
    bw = copy_bandwidth(timer)  # bytes/ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weight = make_quant_weight(N, K, 4, GROUP, "cuda")
    weight_bytes = weight["weight_packed"].numel() * 4 + weight["weight_scale"].numel() * 2
    figures: dict = {}
    buckets: list[dict] = []
    stop = time.time() + min(seconds, seconds_left() - 10)
    for m in BUCKETS:
        x = torch.randn(m, K, dtype=torch.float16, device="cuda")
        bucket = time_bucket(m, x, weight, candidates(m, sms), timer, (weight_bytes + 2 * m * (K + N)) / bw, stop)
        figures |= bucket.pop("figures")
        buckets.append(bucket)
        write(out, {"shape": [K, N], "group": GROUP, "figures": figures, "buckets": buckets})
        if "stopped" in figures:
            break


def bench_figures(bench: Path, out: Path) -> None:
    """One line per paged-attention row and per W4/W8 row of the largest 7B projection: time, speed-up over the
    torch baseline, fraction of the bandwidth bound."""
    data = json.loads(bench.read_text())
    figures: dict = {"device": data["device"], "copy_bandwidth_gb_s": round(data["copy_bandwidth_gb_s"], 1)}
    for r in data["rows"]:
        line = f"{1e3 * r['triton_ms']:.1f}us {r['speedup']:.2f}x torch {100 * r['bandwidth_fraction']:.0f}% of bw"
        if r["kernel"] == "paged_attention":
            figures[f"attention {r['shape'].split()[-1]} b{r['m']}"] = line
        elif r["kernel"] == "quant_matmul" and "4096x11008" in r["shape"]:
            figures[f"{r['shape'].split()[-1]} 4096x11008 m{r['m']}"] = line
    write(out, data | {"figures": figures})
