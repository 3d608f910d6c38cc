"""Speculation and the 8-bit KV cache against plain greedy decoding, on every request of the bench workload.

Runs the seeded `quantkit bench` workload (``quantkit.bench.workload.make_workload``) through one engine per
configuration: no speculation (the reference), n-gram speculation, draft-model speculation (``--draft-model``, e.g.
a W4 checkpoint of the same model) and, for the KV cache, ``int8``; each both alone (one request at a time) and
batched (every request at once, continuous batching). Speculative rows must give exactly the reference's tokens on
every request; the int8 row reports its greedy token agreement (the issue's bar: 99%).

    python -m benchmarks.spec_identity --model smollm2-135m --draft-model ./smollm2-w4-rtn --requests 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quantkit.bench.run import run_engine, warm_up
from quantkit.bench.workload import make_workload
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.engine import Engine


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> tuple[int, float]:
    """(requests with identical tokens, share of reference positions where the tokens agree)."""
    same = sum(a == b for a, b in zip(reference, tokens, strict=True))
    total = sum(len(a) for a in reference)
    matched = sum(sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(reference, tokens, strict=True))
    return same, matched / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft-model", default=None, help="draft rows: a smaller model with the same tokenizer")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--workload", default="mixed", help="free, copy or mixed (bench workloads)")
    parser.add_argument("--k", type=int, default=4, help="tokens drafted per step")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    configs = {"reference": EngineConfig(), "ngram": EngineConfig(speculative="ngram", num_speculative_tokens=args.k)}
    if args.draft_model:
        configs["draft"] = EngineConfig(
            speculative="draft", draft_model=args.draft_model, num_speculative_tokens=args.k
        )
    configs["int8 KV"] = EngineConfig(kv_cache_dtype="int8")
    rows, reference = [], {}
    console = Console()
    for name, config in configs.items():
        engine = Engine(args.model, config)
        requests = make_workload(engine.tokenizer, args.requests, args.workload, 0, engine.max_model_len)
        warm_up(engine)
        for mode, concurrency in (("alone", 1), ("batched", None)):
            began = time.perf_counter()
            run = run_engine(engine, requests, concurrency)
            tokens = [r.tokens for r in run.records]
            if name == "reference":
                reference[mode] = tokens
            same, share = agreement(reference[mode], tokens)
            rows.append(
                {
                    "config": name,
                    "mode": mode,
                    "requests": len(tokens),
                    "identical_requests": same,
                    "token_agreement": share,
                    "output_tokens": sum(len(t) for t in tokens),
                    "seconds": time.perf_counter() - began,
                    "acceptance": (run.speculation or {}).get("acceptance_rate"),
                }
            )
            console.print(rows[-1])
        del engine
    table = Table(title=f"Greedy output vs no speculation, {args.requests} {args.workload} requests on {args.model}")
    for col in ("config", "mode", "identical requests", "token agreement", "output tokens", "s", "acceptance"):
        table.add_column(col, justify="right")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        table.add_row(
            r["config"],
            r["mode"],
            f"{r['identical_requests']}/{r['requests']}",
            f"{r['token_agreement']:.4f}",
            str(r["output_tokens"]),
            f"{r['seconds']:.1f}",
            acc,
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if any(r["config"] in ("ngram", "draft") and r["identical_requests"] != r["requests"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
