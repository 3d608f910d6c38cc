"""A tiny random Gemma 3 text model (gemma3_text): three sliding-window layers (window 6) and one global layer, norm
weights stored around zero as Gemma stores them."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

WINDOW = 6
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 71, 9, 200]  # 14 tokens: more than twice the window
LAYER_TYPES = ("sliding_attention", "full_attention")
CONFIG = dict(
    hidden_size=128, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, vocab_size=256, max_position_embeddings=128, sliding_window=WINDOW,
    layer_types=["sliding_attention"] * 3 + ["full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
    initializer_range=0.1,
)  # fmt: skip


def tiny_gemma3(**overrides) -> PreTrainedModel:
    """float32, eval mode, eager attention (transformers' sdpa attention refuses soft-capping)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma3_text", **{**CONFIG, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)  # stored around zero: the norm scales by 1 + weight
    return model


def generate(model: PreTrainedModel, prompt: list[int], tokens: int) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()
