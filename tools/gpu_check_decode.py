"""Steady-state decode of the engine on a quantized checkpoint: tokens/s at each batch size against the bandwidth
roofline, the engine's own stage profile, and the share of a decode step the GPU spends in kernels.

Every batch size is run once untimed first: Triton specialises integer arguments equal to 1 or divisible by 16, so
batch 1 and batch 16 each compile their own kernels, which must not land in a timed loop. The roofline is the copy
bandwidth (CUDA events) over the bytes a decode step must read: every stored tensor but the embedding (``batch``
rows gathered), plus the KV cache at the mean context. The kernel share is GPU kernel time per step (torch
profiler) over the unprofiled wall time per step: the rest is launch and Python overhead, what CUDA graphs remove.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tools.gpu_check_common import copy_bandwidth, device_name, seconds_left, write

TOP_KERNELS = 6


def _kv_memory(checkpoint: Path, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache holding ``tokens`` tokens (all layers, K and V), with 25% to spare."""
    from quantkit.format.files import read_checkpoint_config

    c = read_checkpoint_config(checkpoint)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return int(1.25 * tokens * per_token)


def weight_bytes_per_step(checkpoint: Path, batch: int) -> int:
    """Bytes of stored tensors a decode step reads: all of them, but only ``batch`` rows of an untied embedding."""
    from quantkit.format.files import read_checkpoint_config, shard_files
    from quantkit.format.safetensors_stream import stored_tensors

    tied = bool(read_checkpoint_config(checkpoint).get("tie_word_embeddings", False))
    total = 0
    for f in shard_files(checkpoint):
        for name, t in stored_tensors(f).items():
            total += t.nbytes // t.shape[0] * batch if name.endswith("embed_tokens.weight") and not tied else t.nbytes
    return total


def _add(engine, batch: int, prompt_len: int, tokens: int, seed: int) -> None:
    from quantkit.runtime.sampling_params import SamplingParams

    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_batch(engine, batch: int, prompt_len: int, tokens: int, seed: int) -> dict:
    """Prefill ``batch`` prompts in one step, then time the decode steps to the end (the prefill excluded)."""
    _add(engine, batch, prompt_len, tokens, seed)
    engine.step()
    _sync()
    engine.profile.reset()
    steps = produced = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        produced += len(engine.step())
        steps += 1
    _sync()
    seconds = time.perf_counter() - start
    stages = {k: round(1e3 * v / max(steps, 1), 3) for k, v in engine.profile.seconds.items()}
    return {"decode_steps": steps, "tokens": produced, "seconds": seconds, "profile_ms_per_step": stages}


def _device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def kernel_share(engine, batch: int, prompt_len: int, steps: int = 8) -> dict:
    """GPU kernel time per decode step (profiled) over the wall time of an unprofiled decode step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _add(engine, batch, prompt_len, 2 * steps + 2, seed=99)
    engine.step()
    engine.step()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    wall_us = 1e6 * (time.perf_counter() - start) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:  # on the CPU (a dry run) it finds no GPU kernels: share 0
        for _ in range(steps):
            engine.step()
        _sync()
    while engine.has_unfinished():
        engine.step()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total = sum(_device_us(e) for e in kernels) / steps
    top = sorted(kernels, key=_device_us, reverse=True)[:TOP_KERNELS]
    return {
        "batch": batch,
        "wall_us_per_step": round(wall_us, 1),
        "kernel_us_per_step": round(total, 1),
        "kernel_share": round(total / wall_us, 3),
        "top_kernels": [{"name": e.key[:80], "us_per_step": round(_device_us(e) / steps, 1)} for e in top],
    }


def decode(checkpoint: Path, out: Path, batches: list[int], tokens: int, prompt_len: int, dtype_name: str) -> None:
    from quantkit.runtime.engine import Engine

    dtype = getattr(torch, dtype_name)
    bandwidth = copy_bandwidth()
    longest = prompt_len + tokens
    start = time.perf_counter()
    engine = Engine(
        checkpoint,
        dtype=dtype_name,
        device=device_name(),
        max_num_seqs=max(batches),
        max_model_len=longest + 16,
        max_num_batched_tokens=max(4096, max(batches) * prompt_len),
        kv_cache_memory=_kv_memory(checkpoint, max(batches) * (longest + 32), dtype),
    )
    cfg = engine.model.config
    data: dict = {"backend": engine.runner.backend.name, "dtype": dtype_name, "prompt_len": prompt_len, "rows": []}
    figures: dict = {"backend": data["backend"], "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)}
    figures["load_s"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    for batch in batches:  # every specialisation compiled before anything is timed
        run_batch(engine, batch, prompt_len, 3, seed=batch + 1000)
    figures["warmup_s"] = round(time.perf_counter() - start, 1)
    write(out, data | {"figures": figures})
    for batch in batches:
        row = run_batch(engine, batch, prompt_len, tokens, seed=batch)
        context = prompt_len + tokens / 2  # mean context over the decode steps
        kv_bytes = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        step_bytes = weight_bytes_per_step(checkpoint, batch) + kv_bytes
        roofline = batch * bandwidth / step_bytes
        rate = row["tokens"] / row["seconds"]
        row |= {"batch": batch, "tokens_per_s": rate, "ms_per_step": 1e3 * row["seconds"] / max(row["decode_steps"], 1)}
        row |= {
            "bytes_per_step": step_bytes,
            "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": rate / roofline,
        }
        data["rows"].append(row)
        figures[f"b{batch}_tok_s"] = round(rate, 1)
        figures[f"b{batch}_ms_per_step"] = round(row["ms_per_step"], 2)
        figures[f"b{batch}_of_roofline"] = round(rate / roofline, 3)
        stages = row["profile_ms_per_step"]  # Engine.profile: where a step's wall time goes
        figures[f"b{batch}_profile_ms"] = " ".join(f"{k} {v:.2f}" for k, v in stages.items() if v >= 0.005)
        write(out, data | {"figures": figures})
        if seconds_left() < 20:
            break
    data["kernel_share"] = []
    for batch in batches[:2]:
        if seconds_left() < 15:
            break
        share = kernel_share(engine, batch, prompt_len)
        data["kernel_share"].append(share)
        if torch.cuda.is_available():
            figures[f"b{batch}_kernel_share"] = share["kernel_share"]
    if torch.cuda.is_available():
        figures["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    write(out, data | {"figures": figures})
