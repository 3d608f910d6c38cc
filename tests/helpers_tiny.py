"""Tiny Llama models and a reference round-to-nearest quantizer for tests (no hub access needed)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.quantization.solvers.grid import quantize_rtn


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """Hidden 64, 2 layers, 4 heads (2 kv), intermediate 160 (not a multiple of 64), vocab 256."""
    params: dict[str, object] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 160,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    params.update(overrides)
    return LlamaConfig(**params)


def tiny_llama(seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama in float32, in eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(torch.float32)
    return model.eval()


def rtn_for_tests(
    weight: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> QuantizedWeight:
    """Round-to-nearest test weights; with act-order (no static groups) a random column permutation stands in
    for the Hessian order, so groups are formed in permuted order and g_idx is recorded."""
    w = weight.detach().float()
    if not (scheme.act_order and not scheme.static_groups):
        return quantize_rtn(w, scheme, scale_dtype=scale_dtype)
    k = w.shape[1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    permuted = quantize_rtn(w[:, perm], scheme, scale_dtype=scale_dtype)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // scheme.group_len(k)).to(torch.int32)
    qweight = permuted.qweight[:, torch.argsort(perm)]
    return QuantizedWeight(qweight=qweight, scale=permuted.scale, zero=permuted.zero, g_idx=g_idx, scheme=scheme)


def logit_error(model_dir: str | Path, checkpoint: str | Path, calib: str | Path) -> float:
    """Mean squared logit error of a quantized checkpoint against its float model, on a calibration file's windows."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantkit.model.resolve import load_model

    ids = load_file(str(calib))["input_ids"].long()
    float_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    quantized = load_model(str(checkpoint), device="cpu")
    with torch.inference_mode():
        expected = float_model(input_ids=ids).logits
        return float((quantized(input_ids=ids).logits.float() - expected).square().mean())
