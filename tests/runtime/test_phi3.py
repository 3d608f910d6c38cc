"""The runtime serves Phi-3 (model_type phi3): its checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one
``gate_up_proj`` (float or quantized as one linear each), which the runtime loads as they are. fp32 logits within
1e-5 of transformers (whole and partial rotary, tied head), greedy tokens equal to ``generate``, continuous batching
equal to one request at a time, a quantized checkpoint equal to quantkit's own loader, and rope types the runtime
lacks (Phi-3's longrope) refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.runtime import engine_logits, greedy, hf_logits, small_engine, small_llm
from helpers.tiny import build_word_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from quantkit.errors import QuantkitError
from quantkit.model.resolve import load_model as load_reference
from quantkit.runtime.layers import MLP, Attention
from quantkit.runtime.model import ModelConfig

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 71]
_CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.1,
)
# Phi-4-mini's layout at tiny size: a quarter of each head left unrotated (here a half), the head tied
VARIANTS: dict[str, dict] = {
    "phi3": {},
    "partial_rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    "tied": dict(tie_word_embeddings=True),
}


def tiny_phi3(**overrides) -> PreTrainedModel:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("phi3", **{**_CONFIG, **overrides})
    return AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    root = tmp_path_factory.mktemp("phi3")
    out = {}
    for name, overrides in VARIANTS.items():
        model = tiny_phi3(**overrides)
        model.save_pretrained(root / name)
        build_word_tokenizer(vocab_size=256).save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


_engine, _llm = small_engine, small_llm


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logits_match_transformers(variant: str, phi3) -> None:
    model, path = phi3[variant]
    engine = _engine(path)
    ours, expected = engine_logits(engine, PROMPT), hf_logits(model, PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5, f"{variant}: max logit error {error:.2e}"
    layer = engine.model.model.layers[0]
    assert isinstance(layer.self_attn, Attention) and isinstance(layer.mlp, MLP)
    assert layer.self_attn.q_proj is None and layer.self_attn.qkv_proj is not None  # the stored fused matrix, as is
    assert layer.mlp.gate_proj is None and layer.mlp.gate_up_proj is not None
    assert torch.equal(layer.self_attn.qkv_proj.weight, model.model.layers[0].self_attn.qkv_proj.weight)


def test_partial_rotary_leaves_the_tail_of_each_head_unrotated(phi3) -> None:
    """With partial_rotary_factor 0.5 the table covers half of each 16-wide head; rotating whole heads instead
    gives other logits, so the match above is not by accident."""
    _, path = phi3["partial_rotary"]
    engine = _engine(path)
    cos = engine.model.model.rotary.cos
    assert cos is not None and cos.shape[-1] == 8
    whole = tiny_phi3()  # the same weights (same seed and shapes), every dimension rotated
    assert (hf_logits(whole, PROMPT) - engine_logits(engine, PROMPT)).abs().max() > 1e-3


def test_greedy_tokens_match_generate(phi3) -> None:
    model, path = phi3["phi3"]
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        expected = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    (out,) = _llm(path).generate(PROMPT, greedy(16))
    assert out.token_ids == expected[0, len(PROMPT) :].tolist()


def test_continuous_batching_equals_one_at_a_time(phi3) -> None:
    _, path = phi3["phi3"]
    prompts = [PROMPT, PROMPT[:3], [5, 200, 12, 44, 7, 100, 8], [2], [1, 17, 42, 99, 140, 141, 142, 143, 144]]
    solo = [_llm(path).generate(p, greedy(12))[0] for p in prompts]
    batched = _llm(path, max_num_seqs=8).generate(prompts, greedy(12))
    assert [o.token_ids for o in batched] == [o.token_ids for o in solo]


def test_quantized_checkpoint_matches_quantkit_loader(phi3, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``quantkit quantize --method rtn``: qkv_proj and gate_up_proj are quantized as one linear each, the runtime
    loads those tensors under their fused names, and its logits equal the dequantizing reference loader's."""
    model, path = phi3["phi3"]
    out = tmp_path / "q"
    code, _, err = run_cli(["quantize", str(path), "-o", str(out), "--method", "rtn", "--group-size", "32"], capsys)
    assert code == 0, err
    engine = _engine(out)
    ours, expected = engine_logits(engine, PROMPT), hf_logits(load_reference(out), PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5, f"max logit error against the reference loader {error:.2e}"
    assert (ours - hf_logits(model, PROMPT)).abs().max() > 1e-3  # the quantized projections were used


def test_sliding_window_is_on_by_default(phi3) -> None:
    """Phi-3's config.json gives sliding_window without use_sliding_window (Phi-3-mini: 2047): it applies."""
    _, path = phi3["phi3"]
    cfg = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf({**cfg, "sliding_window": 2047}).sliding_window == 2047


@pytest.mark.parametrize(
    ("rope", "named"),
    [
        # Phi-3-mini-128k / Phi-3.5-mini / Phi-4-mini: hub config.json spells it rope_scaling.type
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
            "rope_scaling.type",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, "rope_parameters.rope_type"),
    ],
)
def test_unsupported_rope_type_is_refused_in_one_line(rope: dict, named: str, phi3) -> None:
    _, path = phi3["phi3"]
    cfg = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "rope_parameters"}
    with pytest.raises(QuantkitError) as info:
        ModelConfig.from_hf({**cfg, **rope})
    message = str(info.value)
    assert "\n" not in message and named in message and "'longrope'" in message


def test_partial_rotary_stays_refused_where_transformers_rotates_whole_heads() -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100}
    with pytest.raises(QuantkitError, match=r"partial_rotary_factor 0\.5"):
        ModelConfig.from_hf({**base, "model_type": "llama", "intermediate_size": 96, "partial_rotary_factor": 0.5})
    phi = ModelConfig.from_hf({**base, "model_type": "phi3", "intermediate_size": 96, "partial_rotary_factor": 0.75})
    assert (phi.rope.partial_rotary_factor, phi.fused_qkv, phi.fused_gate_up) == (0.75, True, True)
