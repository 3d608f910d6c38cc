"""Serving benchmark: the quantkit engine vs Hugging Face ``generate`` with static batches, same requests.

A fixed set of requests (prompts cut from real text at varied lengths, varied max_tokens) runs greedily in fp32
through both, in the same process. All requests arrive at t=0. Reported: useful generated tokens per second
(tokens each request asked for, up to and including its EOS), mean time to first token, mean time per output
token (after the first), and the engine/HF ratios; plus how many requests produced identical tokens.

    python scripts/bench_serve.py                      # SmolLM2-135M, 32 requests, HF batches of 8
    python scripts/bench_serve.py --model ./my-w4-ckpt --num-requests 16 --skip-hf
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "calibration" / "austen_persuasion_eval.txt"
PROMPT_LENS = (12, 24, 40, 64, 96, 128, 160, 200)
MAX_TOKENS = (16, 32, 48, 64, 96, 128)


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Result:
    tokens: list[int] = field(default_factory=list)
    ttft: float = 0.0  # seconds from t0 to the first token
    done: float = 0.0  # seconds from t0 to the last token

    @property
    def tpot(self) -> float | None:
        return (self.done - self.ttft) / (len(self.tokens) - 1) if len(self.tokens) > 1 else None


def make_requests(tokenizer, n: int, seed: int) -> list[Request]:
    ids = tokenizer(TEXT.read_text()[:200_000]).input_ids
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = PROMPT_LENS[i % len(PROMPT_LENS)]
        start = rng.randrange(0, len(ids) - length)
        out.append(Request(ids[start : start + length], rng.choice(MAX_TOKENS)))
    return out


def useful(tokens: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """The tokens a request asked for: at most max_tokens, up to and including the first EOS."""
    tokens = tokens[:max_tokens]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def run_engine(llm, requests: list[Request]) -> tuple[list[Result], float]:
    from quantkit.runtime.sampling_params import SamplingParams

    engine = llm.engine
    t0 = time.perf_counter()
    index = {
        engine.add_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens)): i
        for i, r in enumerate(requests)
    }
    results = [Result() for _ in requests]
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                res = results[index[out.request_id]]
                res.tokens, res.ttft, res.done = out.token_ids, out.first_token_time - t0, out.finish_time - t0
    return results, time.perf_counter() - t0


def run_hf(model, tokenizer, requests: list[Request], batch_size: int, eos: set[int]) -> tuple[list[Result], float]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):  # once per generation step, after the forward pass
            self.times.append(time.perf_counter())
            return scores

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    results = [Result() for _ in requests]
    t0 = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        clock = StepClock()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in batch),
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )
        for i, r in enumerate(batch):
            tokens = useful(out[i, width:].tolist(), r.max_tokens, eos)
            res = results[b + i]
            res.tokens, res.ttft, res.done = tokens, clock.times[0] - t0, clock.times[len(tokens) - 1] - t0
    return results, time.perf_counter() - t0


def summary(results: list[Result], wall: float) -> dict[str, float]:
    tokens = sum(len(r.tokens) for r in results)
    tpots = [t for r in results if (t := r.tpot) is not None]
    return {
        "tokens": tokens,
        "wall": wall,
        "tok_s": tokens / wall,
        "ttft": statistics.mean(r.ttft for r in results),
        "tpot": statistics.mean(tpots) if tpots else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or quantized checkpoint")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="only run the engine")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from quantkit.runtime.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 110))
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, kv_cache_memory=256 * 1024**2)
    tokenizer = llm.tokenizer
    eos = set(llm.engine.scheduler.eos_token_ids)
    requests = make_requests(tokenizer, args.num_requests, args.seed)
    console.print(
        f"{len(requests)} requests, prompts {min(len(r.prompt) for r in requests)}-"
        f"{max(len(r.prompt) for r in requests)} tokens, max_tokens {min(r.max_tokens for r in requests)}-"
        f"{max(r.max_tokens for r in requests)}; torch threads {torch.get_num_threads()}"
    )

    warmup = [Request(list(range(1000, 1000 + n)), 4) for n in (8, 24)]  # not a prefix of any real request
    run_engine(llm, warmup)
    engine_res, engine_wall = run_engine(llm, requests)
    rows = {"engine": summary(engine_res, engine_wall)}
    matches = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        if llm.engine.path.joinpath("config.json").read_text().find("quantization_config") >= 0:
            from quantkit.format.loader import load_quantized_model

            hf = load_quantized_model(llm.engine.path, dtype=torch.float32)
        else:
            hf = AutoModelForCausalLM.from_pretrained(llm.engine.path, dtype=torch.float32).eval()
        run_hf(hf, tokenizer, warmup, 2, eos)
        hf_res, hf_wall = run_hf(hf, tokenizer, requests, args.hf_batch_size, eos)
        rows[f"HF generate, batches of {args.hf_batch_size}"] = summary(hf_res, hf_wall)
        pairs = zip(engine_res, hf_res, requests, strict=True)
        matches = sum(useful(e.tokens, r.max_tokens, eos) == h.tokens for e, h, r in pairs)

    table = Table(title=f"bench_serve: {args.model}, {len(requests)} requests, greedy fp32")
    for col in ("runner", "useful tokens", "wall s", "tokens/s", "mean TTFT s", "mean TPOT ms"):
        table.add_column(col, justify="right" if col != "runner" else "left")
    for name, s in rows.items():
        tpot = f"{s['tpot'] * 1e3:.0f}"
        table.add_row(name, str(s["tokens"]), f"{s['wall']:.1f}", f"{s['tok_s']:.1f}", f"{s['ttft']:.2f}", tpot)
    if len(rows) == 2:
        e, h = rows.values()
        table.add_row(
            "engine / HF",
            "",
            f"{e['wall'] / h['wall']:.2f}x",
            f"[bold]{e['tok_s'] / h['tok_s']:.2f}x[/bold]",
            f"{e['ttft'] / h['ttft']:.2f}x",
            f"{e['tpot'] / h['tpot']:.2f}x",
        )
    console.print(table)
    if matches is not None:
        console.print(f"identical greedy tokens: {matches}/{len(requests)} requests")
    console.print(f"engine preemptions: {llm.engine.num_preemptions}")


if __name__ == "__main__":
    main()
