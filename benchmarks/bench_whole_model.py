"""Mixed precision under whole-checkpoint budgets (every byte of the files counts) against uniform schemes, in and
out of the calibration domain, each comparison paired window by window (SmolLM2).

Each uniform scheme is quantized; its checkpoint's size (the safetensors files, as the recipes' ``max_checkpoint_mb``
gate counts them) becomes a budget; ``plan --whole-model --max-size-mb`` plans a checkpoint of at most that size from
one sensitivity measurement, and the plan is compared with the uniform scheme of that size (equal or larger than the
plan's; the smaller ones that fit are worse than it), on held-out Persuasion (in domain) and held-out Moby-Dick
(out of domain). ``--extra-budgets`` adds budgets between the uniform sizes, compared with the largest scheme that
fits. A budget that only the smallest candidate everywhere could meet (the smallest uniform scheme's own size, less
the planner's bound on the files' headers) is skipped: there the plan could only be that scheme.

    python -m quantkit sensitivity smollm2-135m -o m.json --candidates int3-g64,int4-g128,int4-g64,int4-g32,int8,fp16
    python -m benchmarks.bench_whole_model --measurement m.json --extra-budgets 140 --record mixed_whole_model

With ``--rotate`` the plans' runs also rotate (``--rotate hadamard``), which unties SmolLM2's head: the head and the
embedding are then planned units (``--head auto --embedding auto --untied-head``, from a measurement taken with
``sensitivity --outer``), so the plan may spend the float embedding's bytes on the linears. The uniform schemes are
not rotated: the row compares what a user can ship at that size with the planner and the rotation against a plain
uniform scheme. ``--reuse-uniform DIR`` takes the uniform checkpoints (and their sizes) from an earlier ``--keep``.

Quantizations run one after the other, each in its own process, with the method's default solver options.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.bench_domains import DOMAINS, IN, OUT
from benchmarks.record import record_table
from quantkit.errors import QuantkitError
from quantkit.eval.evaluate import EvalConfig, evaluate
from quantkit.mixed.measurement import load_measurement
from quantkit.mixed.plan_file import save_plan
from quantkit.mixed.whole_plan import whole_model_plan
from quantkit.model.resolve import resolve_model

UNIFORM = ["int3-g64", "int4-g128", "int4-g64", "int4-g32"]


def quantize(model: str, out: Path, *flags: str) -> int:
    """Quantize in a process of its own; the checkpoint's bytes on disk."""
    summary = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "quantkit", "quantize", model, "-o", str(out), "--force", "--json", str(summary)]
    subprocess.run([*cmd, *flags], check=True, stdout=subprocess.DEVNULL)
    return int(json.loads(summary.read_text())["checkpoint_bytes"])


def scheme_flags(candidate: str) -> list[str]:
    """``quantize`` flags of a uniform candidate spelled as the planner spells it (int4-g64, int8)."""
    bits, _, group = candidate.removeprefix("int").partition("-g")
    return ["--bits", bits, "--group-size", group or "-1"]


def paired(model: Path, against: Path, reference: str, windows: int) -> dict[str, dict[str, Any]]:
    """Per domain: ``model``'s figures against the reference and its paired comparison with ``against``."""
    out = {}
    for domain, text in DOMAINS.items():
        config = EvalConfig(dataset=str(text), max_windows=windows, reference=reference, show_progress=False)
        config.compare = str(against)
        out[domain] = evaluate(model, config).to_dict()
    return out


def cells(row: dict[str, Any]) -> list[str]:
    outer = ", ".join(f"{name} {scheme}" for name, scheme in (row.get("outer") or {}).items())
    plan = f"{row['plan_mb']:.2f}" + (f" ({outer})" if outer else "")
    out = [f"{row['budget_mb']:.2f}", plan, f"{row['uniform']} ({row['uniform_mb']:.2f})"]
    for domain in (IN, OUT):
        r = row[domain]
        c = r["comparison"]
        low, high = c["perplexity_ratio_ci95_pct"]
        kl_other = c.get("kl_mean")
        out += [
            f"{r['kl_mean']:.4f} / {kl_other:.4f} {c['kl_difference']['verdict']}"
            if kl_other is not None
            else f"{r['kl_mean']:.4f}",
            f"{c['perplexity_ratio_pct']:+.2f}% [{low:+.2f}, {high:+.2f}] {c['verdict']}",
        ]
    return out


COLUMNS = [
    "budget MB",
    "plan MB",
    "uniform (MB)",
    "KL plan / uniform (in)",
    "paired ppl plan vs uniform (in)",
    "KL plan / uniform (out)",
    "paired ppl plan vs uniform (out)",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--measurement", type=Path, required=True, help="`quantkit sensitivity` JSON of --model")
    parser.add_argument("--uniform", default=",".join(UNIFORM), help="uniform schemes; their sizes are budgets")
    parser.add_argument("--extra-budgets", default="", help="more budgets in MB (10^6 bytes), comma list")
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--keep", type=Path, default=None, help="keep the checkpoints here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="every row as JSON, rewritten after each")
    parser.add_argument("--record", default=None, help="record the table as benchmarks/results/NAME.json")
    parser.add_argument("--order", type=int, default=51, help="the recorded table's place on the page")
    parser.add_argument("--from-json", type=Path, default=None, help="table (and --record) from an earlier --json")
    parser.add_argument("--rotate", action="store_true", help="plans: rotated runs, head and embedding planned")
    parser.add_argument("--reuse-uniform", type=Path, default=None, help="the uniform checkpoints of an earlier --keep")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 160))
    measurement = load_measurement(args.measurement)
    source = resolve_model(args.model)
    rows: list[dict[str, Any]] = json.loads(args.from_json.read_text()) if args.from_json else []
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        sizes: dict[str, int] = {}
        for name in args.uniform.split(",") if args.from_json is None else []:
            console.print(f"[bold]uniform {name}[/]")
            if args.reuse_uniform is not None:
                summary = json.loads((args.reuse_uniform / f"uniform-{name}.json").read_text())
                sizes[name] = int(summary["checkpoint_bytes"])
                continue
            sizes[name] = quantize(args.model, where / f"uniform-{name}", *scheme_flags(name))
        extra = [float(b) for b in args.extra_budgets.split(",") if b]
        budgets = sorted([size / 1e6 for size in sizes.values()] + extra) if args.from_json is None else []
        for budget in budgets:
            fits = {name: size for name, size in sizes.items() if size / 1e6 <= budget + 1e-9}
            if not fits:
                console.print(f"budget {budget:.1f} MB: no uniform scheme fits; skipped")
                continue
            uniform = max(fits, key=fits.__getitem__)  # the largest that fits: the one of equal size, if any
            try:
                outer = {"head": "auto", "embedding": "auto", "untied_head": True} if args.rotate else {}
                chosen = whole_model_plan(measurement, source, budget, **outer)
            except QuantkitError as exc:  # the smallest candidate everywhere, with the files' headers, is larger
                console.print(f"budget {budget:.1f} MB: {exc}; skipped")
                continue
            plan_file = save_plan(chosen, where / f"plan-{budget:.1f}.yaml")
            console.print(f"[bold]plan at {budget:.1f} MB[/] (against {uniform})")
            rotate = ["--rotate", "hadamard"] if args.rotate else []
            plan_bytes = quantize(args.model, where / f"plan-{budget:.1f}", "--plan", str(plan_file), *rotate)
            row = {"budget_mb": budget, "plan_mb": plan_bytes / 1e6, "uniform": uniform}
            row |= {"uniform_mb": fits[uniform] / 1e6, "predicted": chosen.predicted_error}
            uniforms = args.reuse_uniform or where
            row |= paired(where / f"plan-{budget:.1f}", uniforms / f"uniform-{uniform}", args.model, args.eval_windows)
            row["outer"] = {o.name: o.scheme for o in chosen.outer}
            rows.append(row)
            console.print("  " + " | ".join(cells(row)))
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1, default=str))
    table = Table(title=f"{args.model}: whole-model plans against uniform schemes at their sizes (paired)")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*cells(row))
    console.print(table)
    if args.record:
        counted = "every tensor" if args.rotate else "the tied float embedding and every other tensor"
        record_table(
            args.record,
            title="Mixed precision under whole-checkpoint budgets"
            + (", rotated, with the head and the embedding planned" if args.rotate else ""),
            order=args.order,
            protocol=(
                f"One `quantkit sensitivity` measurement ({measurement.mode}, candidates "
                f"{', '.join(measurement.candidates)}); GPTQ defaults, 128 x 512 calibration windows of the shipped "
                "Austen corpus for every checkpoint. Budgets: each uniform scheme's checkpoint size (safetensors "
                "files, MB = 10^6 bytes) and the extra ones; the plan is `plan --whole-model --max-size-mb BUDGET` "
                f"({counted} counted) and is compared, window by window, with "
                f"the largest uniform scheme that fits the budget; evaluation: {args.eval_windows} windows of 512 "
                "tokens of held-out Persuasion (in) and Moby-Dick chapters 101-135 (out), against the original model."
                + (
                    " Rotated: the plans' runs add --rotate hadamard (the head untied) and plan the head and the "
                    "embedding (--head auto --embedding auto --untied-head, measured with sensitivity --outer on the "
                    "unrotated model); the uniform schemes are plain, not rotated."
                    if args.rotate
                    else ""
                )
            ),
            baseline="the uniform scheme named in the row, on the same windows (paired perplexity ratio, 95% interval)",
            columns=COLUMNS,
            rows=[cells(row) for row in rows],
            notes=[
                "KL plan / uniform: mean KL divergence from the original model of the plan and of the uniform scheme, "
                "and the verdict of their paired difference per window.",
                "A verdict 'better' means the whole 95% interval of the paired perplexity ratio is below 0.",
            ],
        )


if __name__ == "__main__":
    main()
