"""The runtime decoder against Hugging Face (float checkpoints) and load_quantized_model (quantized ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runtime import (
    engine_logits,
    hf_logits,
    save_hf,
    save_quantized,
    tiny_qwen,
)
from helpers.tiny import tiny_llama

from quantkit.errors import QuantkitError
from quantkit.format.loader import load_quantized_model
from quantkit.runtime.engine import Engine
from quantkit.runtime.model import ModelConfig, load_model

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 71]


def _engine(path: Path, **kw) -> Engine:
    return Engine(path, num_kv_blocks=64, block_size=4, max_model_len=128, **kw)


@pytest.mark.parametrize(
    "kind",
    ["llama", "llama-tied", "llama3-rope", "qwen2", "qwen3"],
)
def test_float_logits_match_hf(kind: str, tmp_path: Path) -> None:
    if kind.startswith("qwen"):
        model = tiny_qwen(kind)
    elif kind == "llama-tied":
        model = tiny_llama(tie_word_embeddings=True)
    elif kind == "llama3-rope":
        scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        model = tiny_llama(rope_scaling={**scaling, "original_max_position_embeddings": 32})
    else:
        model = tiny_llama(attention_bias=True)
    path = save_hf(model, tmp_path / kind)
    ours = engine_logits(_engine(path), PROMPT)
    assert torch.allclose(ours, hf_logits(model, PROMPT), atol=2e-5, rtol=0)


def test_quantized_logits_match_dequantized_reference(tmp_path: Path) -> None:
    """Packed weights read directly: logits equal load_quantized_model's (fp32) within 2e-5."""
    path = save_quantized(tiny_llama(), tmp_path / "q")
    reference = load_quantized_model(path, dtype=torch.float32)
    engine = _engine(path)
    assert all(not hasattr(m, "weight_packed") for m in engine.model.modules())  # dequantized once at load
    assert torch.allclose(engine_logits(engine, PROMPT), hf_logits(reference, PROMPT), atol=2e-5, rtol=0)


def test_loader_builds_on_meta_and_shares_tied_embeddings(tmp_path: Path) -> None:
    path = save_hf(tiny_llama(tie_word_embeddings=True), tmp_path / "tied")
    model = load_model(path)
    assert model.lm_head is None
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.model.layers[0].self_attn.qkv is not None  # dense q/k/v fused into one matmul


def test_unsupported_architecture_is_refused() -> None:
    with pytest.raises(QuantkitError, match="not supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_quantized_checkpoint_generates_like_its_reference(tmp_path: Path) -> None:
    from quantkit.runtime.sampling_params import SamplingParams

    path = save_quantized(tiny_llama(seed=3), tmp_path / "q")
    reference = load_quantized_model(path, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        expected = reference.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = _engine(path)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].token_ids == expected[0, len(PROMPT) :].tolist()
