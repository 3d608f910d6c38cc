"""Tiny checkpoints for runtime tests: HF models saved to disk (float and quantized) and a logits helper."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.checkpoint import save_quantized_model
from helpers.tiny import rtn_for_tests, tiny_llama
from quantkit.format.quantization_config import build_quantization_config, parse_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.runtime.attention_backend import AttentionMetadata
from quantkit.runtime.engine import Engine
from quantkit.runtime.llm import LLM
from quantkit.runtime.sampling_params import SamplingParams

QUANT_GROUPS = [
    (QuantScheme(bits=4, group_size=32, symmetric=True), ["Linear"]),
    (QuantScheme(bits=8, group_size=-1, symmetric=False), [r"re:.*down_proj$"]),
    (QuantScheme(bits=3, group_size=16, symmetric=False, act_order=True), [r"re:.*layers\.1\.self_attn\.v_proj$"]),
]


def save_hf(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def save_quantized(model: torch.nn.Module, path: Path, groups=QUANT_GROUPS, ignore=("lm_head",)) -> Path:
    """RTN-quantize every targeted Linear and write a compressed-tensors checkpoint (bf16 storage)."""
    cfg = build_quantization_config(list(groups), list(ignore))
    layout = parse_quantization_config(cfg)
    quantized = {
        name: rtn_for_tests(m.weight, layout.scheme_for(name))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and layout.scheme_for(name) is not None
    }
    return save_quantized_model(model, quantized, cfg, path)


def tiny_qwen(kind: str, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).float().eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common)).float().eval()


def engine_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of ``token_ids`` from one prefill through the engine's runner."""
    engine.add_request(token_ids, SamplingParams(temperature=0, max_tokens=1))
    out = engine.scheduler.schedule()
    assert out.is_prefill and out.num_tokens == [len(token_ids)]
    runner = engine.runner
    input_ids, positions, meta, _ = runner.prepare(out)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(input_ids, positions, meta))
    engine.scheduler.postprocess(out.seqs, [0])  # finishes it (max_tokens=1)
    return logits


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tiny_llama_dir(path: Path, **overrides) -> Path:
    return save_hf(tiny_llama(**overrides), path)


def run_triton_interpreted(script: str, *args: str) -> dict:
    """Run ``script`` (printing one JSON line last) in a fresh process with TRITON_INTERPRET=1, which must be set
    before triton is imported; its JSON. Triton is in the ``gpu`` extra CI installs: without it the script fails."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def paged_meta(
    prefill: bool, tables: list[list[int]], starts: list[int], ns: list[int], block_size: int
) -> AttentionMetadata:
    """Attention metadata for sequences whose pages are ``tables``, each adding ``ns[i]`` tokens at ``starts[i]``."""
    slots, ctx = [], []
    for table, s, n in zip(tables, starts, ns, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s, s + n)]
        ctx.append(s + n)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        is_prefill=prefill,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        query_lens=ns,
        context_lens_list=ctx,
    )


# the small paged cache the per-family runtime tests serve their tiny models with
SMALL_CACHE = {"num_kv_blocks": 64, "block_size": 4, "max_model_len": 128}


def small_engine(path: Path) -> Engine:
    return Engine(path, **SMALL_CACHE)


def small_llm(path: Path, **kw) -> LLM:
    return LLM(path, **SMALL_CACHE, **kw)
