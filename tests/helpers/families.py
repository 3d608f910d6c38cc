"""Tiny random models of each supported family, with non-trivial norm weights and biases, for rotation tests.

Hidden sizes 48 (Paley I order 12 ⊗ 4) and 96 (12 ⊗ 8) exercise non-power-of-two Hadamard rotations; head_dim
is 16 everywhere, and Qwen3's 4 heads x 16 = 64 differ from its hidden 96 (o_proj is not square)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedModel, Qwen2Config, Qwen3Config

from helpers.tiny import tiny_llama_config

_COMMON: dict[str, object] = {
    "num_hidden_layers": 2,
    "intermediate_size": 80,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "head_dim": 16,
    "initializer_range": 0.1,
}
_SHAPES: dict[str, dict[str, object]] = {
    "llama": {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1},
    "mistral": {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "sliding_window": None},
    "qwen2": {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1},
    "qwen3": {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2},
}
FAMILIES = tuple(_SHAPES)


def tiny_config(family: str, tied: bool) -> LlamaConfig | MistralConfig | Qwen2Config | Qwen3Config:
    params = {**_COMMON, **_SHAPES[family], "tie_word_embeddings": tied}
    if family == "llama":
        return tiny_llama_config(**params)
    if family == "qwen2":
        params.pop("head_dim")  # Qwen2 derives it: 48 / 3 = 16
    return {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family](**params)


def tiny_model(family: str, tied: bool, seed: int = 0) -> PreTrainedModel:
    """A float32 model in eval mode whose norm weights lie in [0.5, 1.5] and whose biases are non-zero."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied)).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model
