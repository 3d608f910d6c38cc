"""A tiny random gpt-oss (transformers' gpt_oss): 2 layers (one sliding-window, one full), 8 experts with top-2
routing, YaRN rotary, non-zero biases everywhere (attention, router, experts) and attention sinks, and a SwiGLU
limit low enough that the clamps bite; saved with the tiny models' word tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from helpers.tiny import build_word_tokenizer

NUM_EXPERTS, TOP_K, WINDOW = 8, 2, 8

CONFIG: dict[str, object] = {
    "hidden_size": 128,  # vLLM's Marlin MoE kernel needs a hidden size that is a multiple of 128
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "num_local_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "sliding_window": WINDOW,  # shorter than the calibration windows: the sliding layer's band is exercised
    "swiglu_limit": 1.0,  # the hub's 7.0 never clamps random tiny activations
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_gpt_oss(seed: int = 0, unused_experts: tuple[int, ...] = ()) -> PreTrainedModel:
    """A float32 gpt-oss in eval mode whose biases, sinks and norm weights are random (transformers zeroes biases);
    ``unused_experts``: experts whose router bias is so negative that no token is routed to them."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **CONFIG)).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5 if name.endswith("sinks") else 0.1)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for layer in model.model.layers:
            layer.mlp.router.bias[list(unused_experts)] = -100.0
    return model


def save_tiny_gpt_oss(path: Path, seed: int = 0, unused_experts: tuple[int, ...] = ()) -> Path:
    tiny_gpt_oss(seed, unused_experts).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


def save_tiny_mxfp4_gpt_oss(path: Path, seed: int = 0) -> Path:
    """The tiny gpt-oss as the hub stores gpt-oss: experts as MXFP4 blocks and scales ([out, in] order, random codes
    and exponents 2^-9 .. 2^-4), config.json ``quantization_config`` quant_method "mxfp4", the rest float."""
    from safetensors.torch import save_file

    model = tiny_gpt_oss(seed)
    model.save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    fused = ("experts.gate_up_proj", "experts.down_proj")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith(fused)}
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = int(CONFIG["hidden_size"]), int(CONFIG["intermediate_size"])  # type: ignore[call-overload]
    for layer in range(int(CONFIG["num_hidden_layers"])):  # type: ignore[call-overload]
        prefix = f"model.layers.{layer}.mlp.experts"
        for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            shape = (NUM_EXPERTS, rows, cols // 32)
            state[f"{prefix}.{proj}_blocks"] = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
            state[f"{prefix}.{proj}_scales"] = torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8)
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
    (path / "config.json").write_text(json.dumps(config))
    return path
