"""The docs table of :mod:`benchmarks.bench_scale` (``--record NAME``): one row per method, from its summary."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.record import record_table
from tools.random_model import Shape


def loads_in(load: dict) -> str:
    """The docs' "loads in" cell: which loaders gave finite logits, and what the others did."""
    if not load:
        return "not checked"
    finite = [n for n in ("quantkit", "transformers") if load.get(f"{n}_finite")]
    cell = ", ".join(finite) or "neither"
    if "max_abs_logit_diff" in load and len(finite) == 2:
        cell += f" (max abs logit difference {load['max_abs_logit_diff']:.3g})"
    for name in ("quantkit", "transformers"):
        if name in finite:
            continue
        error = load.get(f"{name}_error")
        reason = error.split(":")[0] if error else "non-finite logits"  # the exception's type, not its message
        cell += f"; not loadable in {name} ({reason})" if error else f"; {name}: {reason}"
    return cell


# docs tables (benchmarks/results/NAME.json): title and place on the page, next to the 1B-shape table (order 40)
RECORD_TITLES = {
    "llama3.2-1b": ("Scale: a 1B-shape model under a RAM cap", 40),
    "qwen3-30b-a3b-e16": ("Scale: a Qwen3-30B-A3B-shape MoE model under a RAM cap", 41),
}
METHOD_LABELS = {"rtn": "RTN", "gptq": "GPTQ (act-order, static groups, MSE clip)"}


def describe(shape: Shape) -> str:
    """The shape in words, for the recorded protocol."""
    width = f"hidden {shape.hidden}, {shape.layers} layers, {shape.heads}/{shape.kv_heads} heads"
    if shape.head_dim is not None:
        width += f" of head_dim {shape.head_dim}"
    if shape.experts is None:
        mlp = f"intermediate {shape.intermediate}"
    else:
        e = shape.experts
        mlp = f"{e.count} experts of intermediate {e.intermediate} per layer, top-{e.top_k} routing"
    head = "tied embeddings" if shape.tied else "untied head"
    return f"{width}, {mlp}, vocab {shape.vocab}, {head}"


def record(name: str, summary: dict, shape: Shape, shard_mb: int) -> Path:
    model = summary["model"]
    title, order = RECORD_TITLES.get(model["preset"], (f"Scale: the {model['preset']} shape under a RAM cap", 49))
    enforcement = summary["runs"][0]["enforcement"] if summary["runs"] else "-"
    protocol = (
        f"A random {shape.model_type} model with the {model['preset']} preset's shapes ({describe(shape)}; "
        f"{model['parameters'] / 1e9:.2f}B parameters, {model['bf16_mb']:.0f} MB in bf16, {model['shards']} shards "
        f"of at most {shard_mb} MB) quantized to {summary['scheme']} on the CPU, each method in a subprocess under a "
        f"cap ({enforcement}) of {summary['cap_fraction']:.0%} of the bf16 size ({summary['cap_mb']:.0f} MB); "
        f"{summary['calibration']} calibration windows of the shipped corpus."
    )
    rows = []
    for run in summary["runs"]:
        blocks = run["block_seconds"][1:] or run["block_seconds"]
        rows.append(
            [
                METHOD_LABELS.get(run["method"], run["method"]),
                f"{run['wall_s']:.0f}"
                if run["ok"]
                else ("killed over the cap" if run["killed_over_cap"] else "failed"),
                f"{statistics.median(blocks):.1f}" if blocks else "-",
                f"{run['peak_rss_mb']:.0f} ({run['peak_rss_mb'] / model['bf16_mb']:.0%})",
                f"{run['peak_anon_mb']:.0f}",
                f"{run['checkpoint_mb']:.0f}",
                loads_in(run.get("load", {})),
            ]
        )
    columns = ["method", "total s", "s/block (median)", "peak RSS MB", "anonymous MB", "checkpoint MB", "loads in"]
    notes = [
        "Peak RSS is VmHWM (shard pages mapped by safetensors included), with its share of the bf16 size; anonymous "
        "is the largest RssAnon polled. s/block: median from the second block on (the first holds the start-up).",
        *run_notes(summary),
    ]
    if shape.experts is not None:
        notes += [
            f"Every expert's statistics come from every calibration token (--moe-calibration all), so a block's work "
            f"grows with its expert count: {shape.experts.count} here, 128 in the real model (not measured).",
            # seen on tiny-moe: transformers' fused 3-D expert parameters come back in bf16 even when asked for float32
            "transformers decompresses the quantized experts into its fused 3-D parameters in bf16, quantkit "
            "dequantizes them to float32: the likely source of the logit difference between the two loaders.",
        ]
    return record_table(
        name,
        title=title,
        order=order,
        protocol=protocol,
        baseline="transformers' logits of the same checkpoint (max abs difference from quantkit's loader's), "
        "where transformers loads it",
        columns=columns,
        rows=rows,
        notes=notes,
        command=summary.get("command"),
    )


def run_notes(summary: dict) -> list[str]:
    """What the figures alone do not say: each block's time and the machine's load (other jobs share its cores),
    and a cgroup filled to the cap by page cache (reclaimed, not a kill)."""
    notes = []
    for run in summary["runs"]:
        times = ", ".join(f"{t:.1f}" for t in run["block_seconds"])
        load = [f"{run[k][0]:.1f}" for k in ("load_average_before", "load_average_after") if k in run]
        busy = f"; load average (1 min) {' before, '.join(load)} after" if len(load) == 2 else ""
        notes.append(f"{METHOD_LABELS.get(run['method'], run['method'])}: seconds per block {times}{busy}.")
    cap = summary["cap_mb"]
    if any((run.get("cgroup_peak_mb") or 0) >= 0.99 * cap and not run["killed_over_cap"] for run in summary["runs"]):
        notes.append(
            "The capped cgroup's charge reached the cap: page cache of the shards read and the files written, which "
            "the kernel reclaims before it kills; the process's own memory is the anonymous column."
        )
    return notes


def main(argv: list[str] | None = None) -> int:
    """Record the table again from a run's ``--json`` summary (e.g. after the protocol's wording changed)."""
    import argparse
    import json

    from benchmarks.bench_scale import preset_shape

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("summary", type=Path, help="bench_scale's --json output")
    parser.add_argument("name", help="benchmarks/results/NAME.json")
    args = parser.parse_args(argv)
    summary = json.loads(args.summary.read_text())
    shape = preset_shape(summary["model"]["preset"], summary["model"].get("layers"))
    print(f"recorded {record(args.name, summary, shape, summary.get('shard_mb', 500))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
