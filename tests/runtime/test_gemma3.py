"""The runtime serves Gemma 3's text model (model_type gemma3_text): RMSNorms that multiply by (1 + weight) in float32,
sandwich norms, a sqrt(hidden)-scaled embedding, GeGLU, query_pre_attn_scalar, and sliding-window layers (window 6
here, prompts and generations longer than that) with their own rotary base. fp32 logits within 1e-5 of
transformers, greedy tokens equal to ``generate``, continuous batching, chunked prefill and the prefix cache equal
to one request at a time, a quantized checkpoint equal to quantkit's own loader, soft-capping as transformers' Gemma 3
applies it (final_logit_softcapping; its attention reads attn_logit_softcapping but never applies it: the attention
cap itself is checked against transformers' Gemma 2 eager attention in test_sliding_window.py), and older
config.json spellings read as transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.gemma import LAYER_TYPES, PROMPT, WINDOW, generate, tiny_gemma3
from helpers.runtime import engine_logits, greedy, hf_logits, small_engine, small_llm
from helpers.tiny import build_word_tokenizer
from transformers import PreTrainedModel

from quantkit.errors import UnsupportedArchitectureError
from quantkit.model.resolve import load_model as load_reference
from quantkit.runtime.layers import OffsetRMSNorm
from quantkit.runtime.model import ModelConfig

# Gemma 2's caps, small enough to bite on this tiny model's logits (Gemma 3 sets neither; given, transformers' Gemma 3
# caps the final logits and leaves the attention scores as they are)
VARIANTS: dict[str, dict] = {
    "gemma3": {},
    # the tied head of a tiny random Gemma echoes the last token (its scaled embedding dominates the final state):
    # generation tests use an untied head, whose tokens vary and depend on the window
    "untied": dict(tie_word_embeddings=False),
    "softcap": dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    root = tmp_path_factory.mktemp("gemma3")
    out = {}
    for name, overrides in VARIANTS.items():
        model = tiny_gemma3(**overrides)
        model.save_pretrained(root / name)
        build_word_tokenizer().save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


_engine, _llm = small_engine, small_llm


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logits_match_transformers(variant: str, gemma3) -> None:
    model, path = gemma3[variant]
    engine = _engine(path)  # max_model_len 128 > the window: served, the window applied
    ours, expected = engine_logits(engine, PROMPT), hf_logits(model, PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5, f"{variant}: max logit error {error:.2e}"
    layers = engine.model.model.layers
    assert [layer.self_attn.window for layer in layers] == [WINDOW, WINDOW, WINDOW, None]
    assert [layer.local_rope for layer in layers] == [True, True, True, False]
    assert isinstance(layers[0].post_feedforward_layernorm, OffsetRMSNorm)
    assert isinstance(layers[0].self_attn.q_norm, OffsetRMSNorm)
    assert layers[0].self_attn.scale == 256**-0.5  # query_pre_attn_scalar, not head_dim
    assert all(layer.self_attn.softcap is None for layer in layers)  # as transformers' Gemma 3, whatever the config


def test_the_window_local_base_and_caps_all_bite(gemma3) -> None:
    """Without the window (or the sliding layers' own rotary base, or the caps) transformers gives other logits:
    the matches above exercise each of them."""
    model, _ = gemma3["gemma3"]
    expected = hf_logits(model, PROMPT)
    no_window = tiny_gemma3(sliding_window=64)
    assert (hf_logits(no_window, PROMPT) - expected).abs().max() > 1e-3
    one_base = tiny_gemma3(rope_parameters={t: {"rope_type": "default", "rope_theta": 1e6} for t in LAYER_TYPES})
    assert (hf_logits(one_base, PROMPT) - expected).abs().max() > 1e-3
    capped, _ = gemma3["softcap"]
    assert (hf_logits(capped, PROMPT) - expected).abs().max() > 1e-3  # the final cap


def test_greedy_tokens_match_generate_past_the_window(gemma3) -> None:
    model, path = gemma3["untied"]
    windowless = tiny_gemma3(tie_word_embeddings=False, sliding_window=64)
    for prompt in (PROMPT[:3], PROMPT):  # inside the window (decode slides past it), already longer than it
        expected = generate(model, prompt, 20)
        assert len(set(expected)) > 8 and expected != generate(windowless, prompt, 20)
        (out,) = _llm(path).generate(prompt, greedy(20))
        assert out.token_ids == expected, prompt


def test_continuous_batching_and_chunked_prefill_equal_one_at_a_time(gemma3) -> None:
    _, path = gemma3["untied"]
    prompts = [PROMPT, PROMPT[:3], [5, 200, 12, 44, 7, 100, 8], [2], [1, 17, 42, 99, 140, 141, 142, 143, 144]]
    solo = [_llm(path).generate(p, greedy(12))[0].token_ids for p in prompts]
    batched = _llm(path, max_num_seqs=8).generate(prompts, greedy(12))
    assert [o.token_ids for o in batched] == solo
    # chunks of 5 tokens: each chunk's queries read the earlier chunk's keys from the pages, within the window
    chunked = _llm(path, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked.generate(prompts, greedy(12))] == solo


def test_prefix_cache_hits_keep_the_window(gemma3) -> None:
    """A prompt whose first blocks are cached from an earlier request prefills only its tail, over keys read back
    from the pages: the same tokens as a fresh engine."""
    _, path = gemma3["untied"]
    longer = [*PROMPT, 60, 61, 62, 63, 64]
    llm = _llm(path)
    llm.generate(PROMPT, greedy(4))
    (cached,) = llm.generate(longer, greedy(12))
    assert cached.num_cached_tokens >= 8  # at least two blocks of 4 from the first request: past the window
    assert cached.token_ids == _llm(path).generate(longer, greedy(12))[0].token_ids


def test_quantized_checkpoint_matches_quantkit_loader(
    gemma3, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``quantkit quantize --method rtn``: the runtime's logits equal the dequantizing reference loader's."""
    model, path = gemma3["gemma3"]
    out = tmp_path / "q"
    code, _, err = run_cli(["quantize", str(path), "-o", str(out), "--method", "rtn", "--group-size", "32"], capsys)
    assert code == 0, err
    ours, expected = engine_logits(_engine(out), PROMPT), hf_logits(load_reference(out), PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5, f"max logit error against the reference loader {error:.2e}"
    assert (ours - hf_logits(model, PROMPT)).abs().max() > 1e-3  # the quantized projections were used


def test_older_config_spellings_and_omitted_defaults_read_as_transformers_reads_them(gemma3) -> None:
    """Hub Gemma 3 configs spell rotary bases as rope_theta / rope_local_base_freq (rope_scaling for the global
    layers), give sliding_window_pattern instead of layer_types, and omit keys equal to the defaults (a tied head,
    query_pre_attn_scalar 256, GeGLU)."""
    _, path = gemma3["gemma3"]
    new = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    old = {
        "model_type": "gemma3_text", "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 7,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }  # fmt: skip
    cfg = ModelConfig.from_hf(old)
    assert cfg.tie_word_embeddings and cfg.family.attn_scale == new.family.attn_scale == 256**-0.5
    assert cfg.family.activation == "gelu_pytorch_tanh" and cfg.family.embed_scale == 128**0.5
    assert [cfg.window(i) for i in range(7)] == [512] * 5 + [None, 512]  # every sixth layer is global
    assert cfg.attention is not None and cfg.attention.local_rope is not None
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, 1e6)
    assert (cfg.attention.local_rope.rope_type, cfg.attention.local_rope.theta) == ("default", 1e4)


def test_bidirectional_attention_is_refused_in_one_line(gemma3) -> None:
    _, path = gemma3["gemma3"]
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(UnsupportedArchitectureError) as info:
        ModelConfig.from_hf({**cfg, "use_bidirectional_attention": True})
    assert "\n" not in str(info.value) and "use_bidirectional_attention" in str(info.value)
