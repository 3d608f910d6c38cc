"""Tiny random mixture-of-experts models of each supported MoE family (2 layers, 8 experts, top-2), with the tiny
models' word tokenizer, and a variant whose router never picks some experts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from helpers.tiny import build_word_tokenizer

MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
NUM_EXPERTS, TOP_K = 8, 2

_COMMON: dict[str, object] = {
    "hidden_size": 128,  # vLLM's Marlin MoE kernel needs a hidden size that is a multiple of 128
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "num_experts_per_tok": TOP_K,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.1,
}
_FAMILY: dict[str, dict[str, object]] = {
    "qwen3_moe": {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 64, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": NUM_EXPERTS, "intermediate_size": 64},
    "qwen2_moe": {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96},
}


def tiny_moe(family: str, seed: int = 0, unused_experts: tuple[int, ...] = ()) -> PreTrainedModel:
    """A float32 MoE model in eval mode. ``unused_experts``: experts no token is routed to (every token's
    residual stream carries a large positive coordinate 0, on which those experts' router rows are negative and
    the others' positive)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**_COMMON, **_FAMILY[family]})
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    if unused_experts:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 8.0
            for layer in model.model.layers:
                router = layer.mlp.gate.weight  # [E, H]
                router[:, 0] = 4.0
                router[list(unused_experts), 0] = -4.0
    return model


def save_tiny_moe(path: Path, family: str, seed: int = 0, unused_experts: tuple[int, ...] = ()) -> Path:
    tiny_moe(family, seed, unused_experts).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path
