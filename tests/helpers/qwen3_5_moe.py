"""A tiny random Qwen3.5-MoE text model (qwen3_5_moe_text): 4 layers alternating gated DeltaNet (linear attention)
and gated full attention with partial rotary, 8 experts top-2 with a shared expert behind its sigmoid gate, and the
tiny models' word tokenizer. Norm weights (stored around zero: the norm multiplies by 1 + w) are randomised so that a
wrong offset or a skipped norm shows in the logits."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from helpers.tiny import build_word_tokenizer

NUM_LAYERS, NUM_EXPERTS, TOP_K = 4, 8, 2
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")

CONFIG: dict[str, object] = {
    "hidden_size": 128,  # vLLM's Marlin MoE kernel needs a hidden size that is a multiple of 128
    "num_hidden_layers": NUM_LAYERS,
    "layer_types": list(LAYER_TYPES),
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # partial_rotary_factor 0.25 (the config's default): 8 of 32 dimensions rotated
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,  # out_proj in-features 64: group size 32 divides it
    "linear_conv_kernel_dim": 4,
    "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 96,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.1,
}


def tiny_qwen3_5_moe(seed: int = 0, initializer_range: float | None = None, **changes: object) -> PreTrainedModel:
    """A float32 Qwen3_5MoeForCausalLM in eval mode; ``initializer_range`` replaces CONFIG's 0.1 (0.02 is the
    config's own default, at which the random model is about as sensitive to quantization as a dense one); ``changes``:
    other entries of CONFIG replaced (e.g. layer_types with num_hidden_layers, tie_word_embeddings)."""
    torch.manual_seed(seed)
    overrides = {} if initializer_range is None else {"initializer_range": initializer_range}
    config = AutoConfig.for_model("qwen3_5_moe_text", **(CONFIG | overrides | changes))
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("_norm.weight") or name == "model.norm.weight":
                param.uniform_(-0.3, 0.3)  # around zero: the norms multiply by 1 + w
    return model


def save_tiny_qwen3_5_moe(path: Path, seed: int = 0, initializer_range: float | None = None, **changes: object) -> Path:
    tiny_qwen3_5_moe(seed, initializer_range, **changes).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path
