"""Quality of the 8-bit KV cache: teacher-forced next-token distributions with an int8 / fp8 cache vs the
unquantized ("auto") cache of the same runtime model.

Held-out text (default: the shipped ``austen_persuasion_eval.txt``) is cut into windows exactly as ``quantkit
eval`` does (``quantkit.eval.evaluate.make_windows``: the tokenizer's BOS convention, non-overlapping windows from
the start). Every window runs through each engine's scheduler, block manager, runner and KV cache, teacher-forced
(the next token of the window is appended instead of a sampled one), with logits at every position:

* ``--mode decode`` (default): one prefill of the first ``--prefill-frac`` of the window, then the rest token by
  token through the decode path: every decode step reads the whole context back from the (8-bit) pages, which is
  how a served completion uses the cache;
* ``--mode chunks``: chunked prefill of the whole window in chunks of ``--chunk`` tokens: each chunk attends to
  the earlier chunks read back from the pages (the prefix-cache / chunked-prefill path).

Metrics per cache (``quantkit.eval.logit_metrics``): perplexity of the window tokens, and against the "auto"
cache the mean and 99th-percentile KL(auto || quantized) and top-1 (greedy) agreement; "KL later" is the mean
KL over the positions computed after a window's first step (the first prefill or chunk), whose context is read
back from the cache. Printed as a table; ``--json OUT`` writes the numbers.

``--workload free|copy|mixed`` scores the seeded ``quantkit bench`` workload instead of text windows: the "auto"
engine answers each request greedily; every engine is then teacher-forced on prompt + that answer (prefill of the
prompt, the answer token by token through the decode path), and the metrics cover the answer's positions, i.e.
the greedy token agreement over the bench workload. "identical" counts the requests each 8-bit cache answers
free-running with exactly the reference's tokens (one early near-tie changes the rest of an answer).

    python -m benchmarks.kv_cache_quality                          # SmolLM2-135M, 20 windows of 256, int8 and fp8
    python -m benchmarks.kv_cache_quality --model ./my-w4-ckpt --mode chunks --chunk 16 --json kv.json
    python -m benchmarks.kv_cache_quality --workload free --requests 32 --formats int8    # the bench workload
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from quantkit.bench.workload import KINDS, make_workload
from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
from quantkit.data.tokens import bos_prefix, encode_documents, join_documents
from quantkit.eval.evaluate import Window, make_windows
from quantkit.eval.logit_metrics import RunningMetrics, token_kl, token_nll
from quantkit.progress import progress_bar
from quantkit.runtime.engine import Engine
from quantkit.runtime.sampling_params import SamplingParams


def build_windows(tokenizer, dataset: str | None, seq_len: int, count: int) -> list[Window]:
    docs = load_documents(dataset if dataset is not None else DEFAULT_EVALUATION)
    stream = join_documents(encode_documents(tokenizer, docs.texts, show_progress=False), tokenizer.eos_token_id)
    prefix = bos_prefix(tokenizer)
    return make_windows(stream, seq_len, seq_len - len(prefix), prefix, count)


def workload_answers(engine: Engine, kind: str, requests: int) -> list[tuple[list[int], int, list[int]]]:
    """(prompt, max_tokens, greedy answer of ``engine``) for each request of the seeded bench workload."""
    workload = make_workload(engine.tokenizer, requests, kind, 0, engine.max_model_len)
    return [(r.prompt, r.max_tokens, greedy(engine, r.prompt, r.max_tokens)) for r in workload]


def greedy(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.token_ids
    return tokens


def make_engine(model: str, kv_cache_dtype: str, args: argparse.Namespace) -> Engine:
    blocks = -(-args.seq_len // args.block_size) + 1  # one window at a time
    return Engine(
        model,
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=blocks,
        block_size=args.block_size,
        max_model_len=args.seq_len + 1,  # chunks mode: the window plus the one token it "samples"
        max_num_seqs=1,
        max_num_batched_tokens=args.chunk if args.mode == "chunks" else args.seq_len + 1,
        enable_chunked_prefill=args.mode == "chunks",
        enable_prefix_caching=False,  # each window computes its own cache
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
    )


@torch.inference_mode()
def teacher_forced_logits(engine: Engine, ids: list[int], mode: str, prefill_len: int) -> tuple[torch.Tensor, int]:
    """fp32 logits ``[len(ids) - 1, V]`` (row ``p`` predicts ``ids[p + 1]``) and the number of rows computed by
    the first scheduled step (the prefill; the rest read the cache back)."""
    runner, scheduler = engine.runner, engine.scheduler
    prompt = ids if mode == "chunks" else ids[:prefill_len]
    # decode mode appends the rest of the window, one token a step; chunks mode finishes after its last chunk
    params = SamplingParams(temperature=0.0, max_tokens=max(1, len(ids) - len(prompt)), ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    rows: list[torch.Tensor] = []
    first = None
    while engine.has_unfinished():
        out = scheduler.schedule()
        (seq,) = out.seqs
        input_ids, positions, meta, _ = runner.prepare(out)
        hidden = runner.model(input_ids, positions, meta)
        rows.append(runner.model.compute_logits(hidden).float().cpu())  # every scheduled position
        first = rows[0].shape[0] if first is None else first
        end = seq.num_computed_tokens + out.num_tokens[0]
        # teacher forcing: the window's next token instead of a sampled one (ignored for a partial chunk)
        scheduler.postprocess(out.seqs, [ids[end] if end < len(ids) else ids[-1]])
    engine.abort(request_id)  # finished by max_tokens; this drops the engine's own record of it (step() did not run)
    logits = torch.cat(rows)[: len(ids) - 1]
    assert first is not None
    return logits, min(first, len(ids) - 1)


def _cell(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or quantized checkpoint")
    parser.add_argument("--dataset", default=None, help="held-out text (default: the shipped eval text)")
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256, help="window length in tokens (workload: max length)")
    parser.add_argument("--workload", choices=KINDS, default=None, help="score the bench workload, not windows")
    parser.add_argument("--requests", type=int, default=32, help="workload: requests")
    parser.add_argument("--formats", nargs="+", default=["int8", "fp8"], choices=["int8", "fp8"])
    parser.add_argument("--mode", choices=["decode", "chunks"], default="decode")
    parser.add_argument("--prefill-frac", type=float, default=0.5, help="decode mode: share of a window prefilled")
    parser.add_argument("--chunk", type=int, default=16, help="chunks mode: tokens per prefill chunk")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.prefill_frac < 1:
        parser.error("--prefill-frac must be between 0 and 1")

    from rich.console import Console
    from rich.table import Table

    console = Console()
    start = time.perf_counter()
    engines = {name: make_engine(args.model, name, args) for name in ["auto", *args.formats]}
    reference = engines["auto"]
    if reference.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: cannot cut text windows")
    if args.workload:  # (ids, prefill length, first scored row): the reference's answers to the bench prompts
        answers = workload_answers(reference, args.workload, args.requests)
        items = [(p + a, len(p), len(p) - 1) for p, _, a in answers if a]
    else:
        windows = build_windows(reference.tokenizer, args.dataset, args.seq_len, args.windows)
        items = [(w.input_ids, max(1, int(len(w.input_ids) * args.prefill_frac)), w.first_scored - 1) for w in windows]
    metrics = {name: RunningMetrics() for name in engines}
    later_kl: dict[str, list[torch.Tensor]] = {name: [] for name in args.formats}
    with progress_bar() as bar:
        task = bar.add_task("Requests" if args.workload else "Windows", total=len(items))
        for ids, prefill_len, first_scored in items:
            targets = torch.tensor(ids[1:])
            ref_logits, first = teacher_forced_logits(reference, ids, args.mode, prefill_len)
            metrics["auto"].add_nll(token_nll(ref_logits[first_scored:], targets[first_scored:]))
            for name in args.formats:
                logits, _ = teacher_forced_logits(engines[name], ids, args.mode, prefill_len)
                metrics[name].add_nll(token_nll(logits[first_scored:], targets[first_scored:]))
                metrics[name].add_reference(ref_logits[first_scored:], logits[first_scored:])
                later_kl[name].append(token_kl(ref_logits[first:], logits[first:]).float())
            bar.advance(task)

    identical = {}
    if args.workload:  # free-running: the same answers, token for token?
        for name in args.formats:
            identical[name] = sum(greedy(engines[name], p, n) == a for p, n, a in answers)
    results = {
        "model": args.model,
        "dataset": args.dataset or f"shipped:{DEFAULT_EVALUATION.name}",
        "workload": args.workload,
        "windows": len(items),
        "seq_len": args.seq_len,
        "mode": args.mode,
        "prefill_frac": args.prefill_frac if args.mode == "decode" else None,
        "chunk": args.chunk if args.mode == "chunks" else None,
        "device": str(reference.device),
        "dtype": str(reference.runner.kv_cache.dtype).replace("torch.", ""),
        "caches": {},
        "seconds": 0.0,
    }
    what = f"{len(items)} {args.workload} bench requests" if args.workload else f"{len(items)} x {args.seq_len} tokens"
    table = Table(title=f"KV cache quality: {args.model}, {what}, {args.mode}")
    for col in ("KV cache", "bytes/token", "ppl", "KL mean", "KL p99", "top-1", "KL later"):
        table.add_column(col, justify="left" if col == "KV cache" else "right")
    for name, engine in engines.items():
        m = metrics[name]
        row = {
            "bytes_per_token": engine.runner.cache.bytes_per_block / args.block_size,
            "perplexity": m.perplexity,
            "tokens": m.tokens,
        }
        if name != "auto":
            kl_mean, kl_p99, top1 = m.kl_summary()
            row |= {"kl_mean": kl_mean, "kl_p99": kl_p99, "top1_agreement": top1}
            row["kl_mean_later_steps"] = float(torch.cat(later_kl[name]).double().mean())
            if args.workload:
                row["identical_requests"] = identical[name]
        results["caches"][name] = row
        table.add_row(
            name,
            f"{row['bytes_per_token']:.0f}",
            f"{row['perplexity']:.4f}",
            *(
                _cell(row, key, spec)
                for key, spec in (("kl_mean", ".2e"), ("kl_p99", ".2e"), ("top1_agreement", ".2%"))
            ),
            _cell(row, "kl_mean_later_steps", ".2e"),
        )
    results["seconds"] = round(time.perf_counter() - start, 1)
    console.print(table)
    for name, same in identical.items():
        console.print(f"{name}: {same}/{len(answers)} requests answered free-running with identical tokens")
    console.print(f"{results['seconds']} s on {results['device']} ({results['dtype']} compute)")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=lambda x: None if math.isnan(x) else x))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
