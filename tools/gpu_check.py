"""The measurements of tools/gpu_check.sh (issue 24, part B), one subcommand each, each writing one JSON object.

    python -m tools.gpu_check env OUT.json
    python -m tools.gpu_check parity MODEL OUT.json [--prompts 8] [--tokens 32]
    python -m tools.gpu_check decode CHECKPOINT OUT.json [--batches 1 16 64] [--tokens 64] [--prompt-len 64]
    python -m tools.gpu_check junit REPORT.xml OUT.json
    python -m tools.gpu_check merge STEP_DIR OUT.json

``parity``: the engine's greedy tokens against HF ``generate`` (one prompt at a time, same dtype and device) on
random prompts; a divergence is reported with HF's margin between its two best logits at that position (a near tie
flips under any change of summation order). ``decode``: steady-state decode throughput of the engine at each batch
size (the prefill step excluded) against the roofline: measured copy bandwidth / bytes read per decode step
(every stored tensor but the embedding, whose B rows are gathered; plus the KV cache read at the mean context).
On a machine without CUDA both run on the CPU in float32 (the script's ``--dry-run``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = "float16" if CUDA else "float32"
NEAR_TIE = 0.1  # logits: a greedy flip at a smaller top-2 margin is within fp16 rounding of the two computations


def write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def env(out: Path) -> None:
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "triton", "transformers", "safetensors", "pydantic", "quantkit"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    data: dict = {"python": platform.python_version(), "versions": versions, "cuda": CUDA}
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        data |= {
            "device": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "memory_gb": props.total_memory / 1e9,
            "multiprocessors": props.multi_processor_count,
            "torch_cuda": torch.version.cuda,
        }
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
            data["nvidia_smi"] = smi.stdout.splitlines()[:12]
        except (OSError, subprocess.TimeoutExpired) as exc:
            data["nvidia_smi"] = str(exc)
    write(out, data)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 41, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def _engine_greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from quantkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[i] for i in ids]


def parity(model: Path, out: Path, prompts: int, tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.engine import Engine

    engine = Engine(model, dtype=DTYPE, device=DEVICE, max_num_seqs=prompts)
    cases = _prompts(prompts, engine.model.config.vocab_size)
    started = time.perf_counter()
    ours = _engine_greedy(engine, cases, tokens)
    engine_s = time.perf_counter() - started
    backend = engine.runner.backend.name  # "triton" on CUDA with triton installed
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    divergences, identical = [], 0
    for i, (prompt, mine) in enumerate(zip(cases, ours, strict=True)):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.inference_mode():
            gen = hf.generate(
                ids,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        theirs = gen.sequences[0, len(prompt) :].tolist()
        if theirs == mine:
            identical += 1
            continue
        at = next(j for j, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
        top2 = gen.logits[at][0].float().topk(2).values
        margin = float(top2[0] - top2[1])
        divergences.append(
            {"prompt": i, "position": at, "engine": mine[at], "hf": theirs[at], "hf_top2_margin": margin}
        )
    write(
        out,
        {
            "device": DEVICE,
            "dtype": DTYPE,
            "backend": backend,
            "prompts": prompts,
            "tokens": tokens,
            "identical": identical,
            "divergences": divergences,
            "near_tie": NEAR_TIE,
            "all_explained": all(d["hf_top2_margin"] < NEAR_TIE for d in divergences),
            "engine_seconds": engine_s,
        },
    )


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s (bytes read + written by a large copy); CPU: a smaller copy."""
    n = (512 << 20) if CUDA else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        _sync()
        start = time.perf_counter()
        dst.copy_(src)
        _sync()
        times.append(time.perf_counter() - start)
    return 2 * n / sorted(times)[len(times) // 2]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _kv_memory(checkpoint: Path, tokens: int) -> int:
    """Bytes of KV cache holding ``tokens`` tokens (all layers, K and V, in the compute dtype), with 25% to spare."""
    from quantkit.format.files import read_checkpoint_config

    c = read_checkpoint_config(checkpoint)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * kv_heads * head_dim * torch.finfo(getattr(torch, DTYPE)).bits // 8
    return int(1.25 * tokens * per_token)


def weight_bytes_per_step(checkpoint: Path, batch: int) -> int:
    """Bytes of stored tensors a decode step reads: all of them, but only ``batch`` rows of an untied embedding."""
    from quantkit.format.files import read_checkpoint_config, shard_files
    from quantkit.format.safetensors_stream import stored_tensors

    tied = bool(read_checkpoint_config(checkpoint).get("tie_word_embeddings", False))
    total = 0
    for f in shard_files(checkpoint):
        for name, t in stored_tensors(f).items():
            if name.endswith("embed_tokens.weight") and not tied:
                total += t.nbytes // t.shape[0] * batch
            else:
                total += t.nbytes
    return total


def decode(checkpoint: Path, out: Path, batches: list[int], tokens: int, prompt_len: int) -> None:
    from quantkit.runtime.engine import Engine
    from quantkit.runtime.sampling_params import SamplingParams

    bandwidth = copy_bandwidth()
    longest = prompt_len + tokens
    engine = Engine(
        checkpoint,
        dtype=DTYPE,
        device=DEVICE,
        max_num_seqs=max(batches),
        max_model_len=longest + 16,
        max_num_batched_tokens=max(4096, max(batches) * prompt_len),
        kv_cache_memory=_kv_memory(checkpoint, max(batches) * (longest + 32)),
    )
    cfg = engine.model.config
    kv_elem = torch.finfo(getattr(torch, DTYPE)).bits // 8
    vocab = cfg.vocab_size
    _engine_greedy(engine, _prompts(2, vocab, seed=1), 4)  # warm-up: compilation, allocator
    rows = []
    for batch in batches:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        gen = torch.Generator().manual_seed(batch)
        for _ in range(batch):
            engine.add_request(torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params)
        engine.step()  # the prefill of every request
        _sync()
        start, steps, produced = time.perf_counter(), 0, 0
        while engine.has_unfinished():
            produced += sum(1 for _ in engine.step())
            steps += 1
        _sync()
        seconds = time.perf_counter() - start
        context = prompt_len + tokens / 2  # mean context over the decode steps
        kv_bytes = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_elem
        step_bytes = weight_bytes_per_step(checkpoint, batch) + kv_bytes
        roofline = batch * bandwidth / step_bytes
        rate = produced / seconds
        rows.append(
            {
                "batch": batch,
                "decode_steps": steps,
                "tokens": produced,
                "seconds": seconds,
                "tokens_per_s": rate,
                "ms_per_step": 1e3 * seconds / max(steps, 1),
                "bytes_per_step": step_bytes,
                "roofline_tokens_per_s": roofline,
                "fraction_of_roofline": rate / roofline,
            }
        )
    write(
        out,
        {
            "device": DEVICE,
            "dtype": DTYPE,
            "checkpoint": str(checkpoint),
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "prompt_len": prompt_len,
            "tokens": tokens,
            "rows": rows,
        },
    )


def junit(report: Path, out: Path) -> None:
    """A pytest junit XML report as counts and the names of the tests that failed."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    write(
        out,
        counts
        | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"], "failed": failed},
    )


def merge(steps: Path, out: Path) -> None:
    """Every ``NAME.json`` a step wrote, with its ``NAME.status.json`` (exit code, seconds, log tail), by step."""
    merged: dict = {}
    for status in sorted(steps.glob("*.status.json")):
        name = status.name.removesuffix(".status.json")
        entry = json.loads(status.read_text())
        result = steps / f"{name}.json"
        if result.is_file():
            try:
                entry["result"] = json.loads(result.read_text())
            except json.JSONDecodeError as exc:
                entry["result_error"] = str(exc)
        merged[name] = entry
    write(out, {"steps": merged})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env").add_argument("out", type=Path)
    p = sub.add_parser("parity")
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    d = sub.add_parser("decode")
    d.add_argument("checkpoint", type=Path)
    d.add_argument("out", type=Path)
    d.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    d.add_argument("--tokens", type=int, default=64)
    d.add_argument("--prompt-len", type=int, default=64)
    j = sub.add_parser("junit")
    j.add_argument("report", type=Path)
    j.add_argument("out", type=Path)
    m = sub.add_parser("merge")
    m.add_argument("steps", type=Path)
    m.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "env":
        env(args.out)
    elif args.command == "parity":
        parity(args.model, args.out, args.prompts, args.tokens)
    elif args.command == "decode":
        decode(args.checkpoint, args.out, args.batches, args.tokens, args.prompt_len)
    elif args.command == "junit":
        junit(args.report, args.out)
    else:
        merge(args.steps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
