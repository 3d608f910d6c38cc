"""Behaviour of quantized checkpoints beside their reference: the `behaviour` figures of `quantkit eval --behaviour
--json` runs, one row for the reference and one per checkpoint, recorded as a table of docs/benchmarks.md.

Each checkpoint is evaluated by the command itself (the reference answers the prompts in every run; its figures are
taken from the first file):

    quantkit eval CKPT --reference smollm2-135m --behaviour --json CKPT.json
    python -m benchmarks.bench_behaviour "W4 g64 GPTQ=w4.json" "W3 g64 RTN=w3.json" --record behaviour
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from benchmarks.record import record_table

COLUMNS = ["model", "end rate", "repetition", "mean reply tokens", "first-32 agreement", "ppl +%", "KL mean"]


def _se(figures: dict[str, Any], key: str) -> str:
    return f"{figures[key]:.3f} ± {figures[f'{key}_se']:.3f}"


def rows_of(runs: list[tuple[str, dict[str, Any]]]) -> list[list[str]]:
    """The reference's row (from the first run), then one row per labelled run."""
    first = runs[0][1]["behaviour"]["reference"]
    rows = [
        ["reference (float)", _se(first, "end_rate"), _se(first, "repetition"), f"{first['mean_reply_tokens']:.1f}"]
    ]
    rows[0] += ["1", "+0.0%", "0"]
    for label, result in runs:
        behaviour = result["behaviour"]
        candidate = behaviour["candidate"]
        rows.append(
            [
                label,
                _se(candidate, "end_rate"),
                _se(candidate, "repetition"),
                f"{candidate['mean_reply_tokens']:.1f}",
                f"{behaviour['first32_agreement']:.3f} ± {behaviour['first32_agreement_se']:.3f}",
                f"{result['perplexity_change_pct']:+.1f}%",
                f"{result['kl_mean']:.3f}",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=EVAL.json, the output of `quantkit eval --behaviour --json`")
    parser.add_argument("--record", help="record the table as benchmarks/results/NAME.json")
    parser.add_argument("--note", action="append", default=[], help="a note under the table (repeatable)")
    parser.add_argument("--title", default="Behaviour: greedy replies to the shipped chat prompts")
    parser.add_argument("--order", type=int, default=27, help="the recorded table's place in docs/benchmarks.md")
    args = parser.parse_args()
    runs, names = [], []
    for spec in args.runs:
        label, _, path = spec.partition("=")
        runs.append((label, json.loads(Path(path).read_text())))
        names.append(shlex.quote(f"{label}={Path(path).name}"))  # the eval files by name: paths are this machine's
    rows = rows_of(runs)
    for row in rows:
        print(" | ".join(row))
    if args.record:
        behaviour = runs[0][1]["behaviour"]
        reference = runs[0][1]["reference"]
        record_table(
            args.record,
            title=args.title,
            order=args.order,
            protocol=(
                f"`quantkit eval CKPT --reference {reference} --behaviour --json CKPT.json` per checkpoint: "
                f"{behaviour['prompts']} chat prompts on held-out Persuasion passages, greedy, at most "
                f"{behaviour['max_new_tokens']} new tokens, batches of 8; ± is one standard error over prompts; "
                "ppl +% and KL mean from the same runs (40 windows of 512 tokens)."
            ),
            baseline=f"the float model ({reference}) answering the same prompts",
            columns=COLUMNS,
            rows=rows,
            notes=args.note,
            command=f"python -m benchmarks.bench_behaviour {' '.join(names)} --record {args.record}"
            + (f" --order {args.order} --title {shlex.quote(args.title)}" if args.order != 27 else ""),
        )


if __name__ == "__main__":
    main()
