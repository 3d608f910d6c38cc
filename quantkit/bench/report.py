"""The benchmark's results as one JSON-ready dict (keys: see :mod:`quantkit.cli.bench`) and as rich tables."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from quantkit.bench.hf_baseline import HFRun, useful
from quantkit.bench.run import EngineRun
from quantkit.bench.workload import BenchRequest, copied_fraction
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.step_profile import STAGES


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    mean = sum(values) / len(values) if values else None
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "mean": mean}


def build_report(
    model: str,
    workload: dict[str, Any],
    config: EngineConfig,
    requests: list[BenchRequest],
    run: EngineRun,
    hf: HFRun | None = None,
    eos: frozenset[int] = frozenset(),
    trace: Path | None = None,
) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in run.records)
    kv_capacity = run.kv_num_blocks * run.block_size
    copied = sum(
        copied_fraction(q.prompt, r.tokens) * len(r.tokens) for q, r in zip(requests, run.records, strict=True)
    )
    return {
        "model": model,
        "workload": {
            **workload,
            "prompt_tokens": sum(len(r.prompt) for r in requests),
            "max_tokens": sum(r.max_tokens for r in requests),
        },
        "engine": dataclasses.asdict(config),
        "wall_s": run.wall,
        "requests_per_s": len(run.records) / run.wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / run.wall,
        "ttft_s": _dist([r.ttft for r in run.records]),
        "tpot_s": _dist([r.tpot for r in run.records if r.tpot is not None]),
        "peak_rss_mb": run.peak_rss / 1e6 if run.peak_rss is not None else None,
        "kv_cache": {
            "peak_usage": run.kv_peak_usage,
            "peak_tokens": round(run.kv_peak_usage * run.kv_num_blocks) * run.block_size,
            "capacity_tokens": kv_capacity,
            "num_blocks": run.kv_num_blocks,
            "block_size": run.block_size,
        },
        "steps": run.steps,
        "stages": _stages(run),
        "speculation": run.speculation,
        "copied_fraction": copied / tokens if tokens else 0.0,
        "preemptions": run.preemptions,
        "hf": _hf(hf, requests, run, eos, tokens) if hf is not None else None,
        "profile_trace": str(trace) if trace is not None else None,
        "per_request": [
            {
                "kind": r.kind,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": len(r.tokens),
                "ttft_s": r.ttft,
                "tpot_s": r.tpot,
                "latency_s": r.latency,
                "finish_reason": r.finish_reason,
            }
            for r in run.records
        ],
    }


def _stages(run: EngineRun) -> dict[str, Any]:
    seconds = {s: run.stage_seconds.get(s, 0.0) for s in STAGES}
    steps = max(run.steps, 1)
    return {
        "seconds": seconds,
        "share_of_wall": {s: v / run.wall for s, v in seconds.items()},
        "ms_per_step": {s: v * 1e3 / steps for s, v in seconds.items()},
        "total_s": sum(seconds.values()),
    }


def _hf(hf: HFRun, requests: list[BenchRequest], run: EngineRun, eos: frozenset[int], tokens: int) -> dict[str, Any]:
    hf_tokens = sum(len(r.tokens) for r in hf.records)
    pairs = zip(run.records, hf.records, requests, strict=True)
    identical = sum(useful(e.tokens, q.max_tokens, set(eos)) == h.tokens for e, h, q in pairs)
    tok_s = hf_tokens / hf.wall
    return {
        "batch_size": hf.batch_size,
        "wall_s": hf.wall,
        "output_tokens": hf_tokens,
        "output_tokens_per_s": tok_s,
        "requests_per_s": len(hf.records) / hf.wall,
        "ttft_s": _dist([r.ttft for r in hf.records]),
        "tpot_s": _dist([r.tpot for r in hf.records if r.tpot is not None]),
        "engine_over_hf": (tokens / run.wall) / tok_s if tok_s else None,
        "identical": identical,
        "compared": len(requests),
    }


def _f(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def render(report: dict[str, Any], console: Console) -> None:
    """The summary (engine, and HF with --compare-hf), speculation and match lines, the per-stage table."""
    console.print(_summary_table(report))
    hf = report["hf"]
    if hf is not None:
        console.print(
            f"engine / HF output tokens/s: [bold]{_f(hf['engine_over_hf'], '.2f')}x[/]; identical greedy tokens: "
            f"{hf['identical']}/{hf['compared']} requests"
        )
    if report["speculation"] is not None:
        s, e = report["speculation"], report["engine"]
        console.print(
            f"speculation {e['speculative']} (K={e['num_speculative_tokens']}): acceptance {s['acceptance_rate']:.1%} "
            f"({s['accepted']}/{s['drafted']} drafts), {s['tokens_per_step']:.2f} tokens per target step"
        )
    console.print(_stage_table(report))
    trace = report["profile_trace"]
    console.print(
        f"{report['output_tokens']:,} output tokens ({report['copied_fraction']:.0%} in 4-token runs of their prompt), "
        f"{report['preemptions']} preemptions" + (f"; trace: {trace} (timings include the profiler)" if trace else "")
    )


def _summary_table(report: dict[str, Any]) -> Table:
    w, kv, hf = report["workload"], report["kv_cache"], report["hf"]
    conc = w["concurrency"] or "all"
    table = Table(title=f"bench {report['model']}: {w['requests']} {w['kind']} requests, concurrency {conc}")
    table.add_column("metric")
    table.add_column("engine", justify="right")
    if hf is not None:
        table.add_column(f"HF generate (batches of {hf['batch_size']})", justify="right")
        table.add_column("engine / HF", justify="right")
    rows = [
        ("requests/s", "requests_per_s", ".2f", 1.0),
        ("output tokens/s", "output_tokens_per_s", ".1f", 1.0),
        ("TTFT p50 (s)", ("ttft_s", "p50"), ".3f", 1.0),
        ("TTFT p95 (s)", ("ttft_s", "p95"), ".3f", 1.0),
        ("TPOT p50 (ms)", ("tpot_s", "p50"), ".1f", 1e3),
        ("TPOT p95 (ms)", ("tpot_s", "p95"), ".1f", 1e3),
    ]
    for label, key, fmt, scale in rows:
        cells = [_f(_get(report, key), fmt, scale)]
        if hf is not None:
            a, b = _get(report, key), _get(hf, key)
            cells += [_f(b, fmt, scale), _f(a / b if a is not None and b else None, ".2f") + "x"]
        table.add_row(label, *cells)
    extra = ["-", ""] if hf is not None else []
    table.add_row("peak RSS (MB)", _f(report["peak_rss_mb"], ".0f"), *extra)
    table.add_row("KV-cache peak", f"{kv['peak_usage']:.2%} ({kv['peak_tokens']:,} tokens)", *extra)
    return table


def _get(d: dict[str, Any], key: str | tuple[str, str]) -> float | None:
    return d[key] if isinstance(key, str) else d[key[0]][key[1]]


def _stage_table(report: dict[str, Any]) -> Table:
    st, wall, steps = report["stages"], report["wall_s"], max(report["steps"], 1)
    table = Table(title=f"engine step by stage: {report['steps']} steps, {wall:.2f} s wall")
    for col in ("stage", "seconds", "% of wall", "ms/step"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage in STAGES:
        table.add_row(
            stage, f"{st['seconds'][stage]:.3f}", f"{st['share_of_wall'][stage]:.1%}", f"{st['ms_per_step'][stage]:.2f}"
        )
    other = max(wall - st["total_s"], 0.0)
    row = (f"{other:.3f}", f"{other / wall:.1%}", f"{other * 1e3 / steps:.2f}")
    table.add_row("outside the stages", *row, style="dim")
    return table
