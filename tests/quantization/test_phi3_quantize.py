"""Phi-3: fused qkv_proj and gate_up_proj solved and stored fused (as vLLM's Phi-3 loads them). RTN, GPTQ and AWQ
quantize a tiny Phi-3; the checkpoint loads in transformers (its compressed-tensors integration replaces the fused
Linears) with the same logits as quantkit's loader, close to the float model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.family_checks import quantized_logits, relative_error
from helpers.tiny import build_word_tokenizer
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("phi3") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize(("method", "bound"), [("rtn", 0.15), ("gptq", 0.03), ("awq", 0.08)])
def test_phi3_quantizes_fused_and_loads_in_transformers(
    method: str,
    bound: float,
    phi3_dir: Path,
    tiny_calib_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "q"
    expected, ours, theirs = quantized_logits(phi3_dir, out, tiny_calib_file, method, capsys)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        assert f"model.layers.0.{fused}.weight_packed" in names
    assert torch.allclose(theirs, ours, atol=1e-4, rtol=1e-4)  # transformers reads what quantkit wrote
    error = relative_error(ours, expected)
    assert error < bound  # measured: RTN 0.086, GPTQ 0.011, AWQ 0.038 (a tiny dense Llama: RTN 0.052, GPTQ 0.004)
    assert json.loads((out / "config.json").read_text())["model_type"] == "phi3"
