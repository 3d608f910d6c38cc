"""llama.cpp's mixes: every tensor's type on the default model's shapes equals the table derived by hand from
llama.cpp's src/llama-quant.cpp (llama_tensor_get_type_impl + tensor_type_fallback, no importance matrix), and a
model with 256-multiple widths gets every K type."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny import build_word_tokenizer, tiny_llama

from quantkit.errors import QuantkitError
from quantkit.model.resolve import arch_for_dir
from quantkit.model.source_weights import SourceWeights
from quantkit.quantization.gguf.mixes import MIXES, Layer, fitted, mix_of, tensor_type, use_more_bits
from quantkit.quantization.gguf.plan import plan_gguf

# SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads (gqa 3), tied embeddings
LAYERS, HIDDEN, INTER, GQA = 30, 576, 1536, 3
ROWS = {"attn_q": HIDDEN, "attn_k": HIDDEN, "attn_v": HIDDEN, "attn_output": HIDDEN}
ROWS |= {"ffn_gate": HIDDEN, "ffn_up": HIDDEN, "ffn_down": INTER}
# use_more_bits(i, 30): i < 3, i >= 26, or (i - 3) % 3 == 2
MORE = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
ALL = set(range(LAYERS))


def rule(default: str, **exceptions: set[int]) -> dict[int, str]:
    """Per layer: ``default``, or the type named by the first keyword whose layer set holds the layer."""
    out = {}
    for i in range(LAYERS):
        out[i] = next((t for t, layers in exceptions.items() if i in layers), default)
    return out


# The table, read from llama.cpp's source for this model (576-wide rows take the fallback of their K type:
# Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0; token_embd is the tied output: 576 % 256 != 0 -> Q8_0)
SMOLLM2: dict[str, dict[str, object]] = {
    "Q4_K_M": {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
               "ffn_up": "Q5_0", "attn_v": rule("Q5_0", Q8_0=MORE), "ffn_down": rule("Q4_K", Q6_K=MORE)},
    "Q4_K_S": {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
               "ffn_up": "Q5_0", "attn_v": rule("Q5_0", Q5_1={0, 1, 2, 3}), "ffn_down": rule("Q4_K", Q5_K={0, 1, 2})},
    "Q5_K_M": {"token_embd": "Q8_0", "attn_q": "Q5_1", "attn_k": "Q5_1", "attn_output": "Q5_1", "ffn_gate": "Q5_1",
               "ffn_up": "Q5_1", "attn_v": rule("Q5_1", Q8_0=MORE), "ffn_down": rule("Q5_K", Q6_K=MORE)},
    "Q5_K_S": {"token_embd": "Q8_0", "attn_q": "Q5_1", "attn_k": "Q5_1", "attn_output": "Q5_1", "ffn_gate": "Q5_1",
               "ffn_up": "Q5_1", "attn_v": "Q5_1", "ffn_down": "Q5_K"},
    "Q3_K_M": {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
               "ffn_up": "Q4_0", "attn_v": rule("Q5_0", Q5_1={0, 1}), "ffn_down": rule("Q4_K", Q5_K={0})},
    "Q3_K_S": {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_output": "Q4_0", "ffn_gate": "Q4_0",
               "ffn_up": "Q4_0", "attn_v": "Q4_0", "ffn_down": "Q3_K"},
    "Q3_K_L": {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_output": "Q5_1", "ffn_gate": "Q4_0",
               "ffn_up": "Q4_0", "attn_v": "Q5_1", "ffn_down": "Q5_K"},
    "Q6_K": {"token_embd": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q8_0",
             "ffn_up": "Q8_0", "attn_v": "Q8_0", "ffn_down": "Q6_K"},
    # gqa 3 < 4: attn_v Q3_K (-> Q4_0); ffn_down and attn_output Q3_K
    "Q2_K": {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_output": "Q4_0", "ffn_gate": "Q4_0",
             "ffn_up": "Q4_0", "attn_v": "Q4_0", "ffn_down": "Q3_K"},
    "Q8_0": {"token_embd": "Q8_0", **{k: "Q8_0" for k in ROWS}},
    # Q4_0: the tied output gets Q6_K (base != Q8_0 and 576 % 32 == 0), which falls back to Q8_0
    "Q4_0": {"token_embd": "Q8_0", **{k: "Q4_0" for k in ROWS}},
}  # fmt: skip


def smollm2_types(mix: str) -> dict[str, str]:
    m = mix_of(mix)
    out = {"token_embd.weight": tensor_type(m, "token_embd.weight", HIDDEN, Layer(0, LAYERS, GQA), tied=True).type}
    for i in range(LAYERS):
        for kind, row in ROWS.items():
            name = f"blk.{i}.{kind}.weight"
            out[name] = tensor_type(m, name, row, Layer(i, LAYERS, GQA), tied=True).type
    return out


def expected(mix: str) -> dict[str, str]:
    table = SMOLLM2[mix]
    out = {"token_embd.weight": str(table["token_embd"])}
    for i in range(LAYERS):
        for kind in ROWS:
            value = table[kind]
            out[f"blk.{i}.{kind}.weight"] = value[i] if isinstance(value, dict) else str(value)
    return out


def test_use_more_bits_on_30_layers() -> None:
    assert {i for i in range(LAYERS) if use_more_bits(i, LAYERS)} == MORE


@pytest.mark.parametrize("mix", list(SMOLLM2))
def test_every_smollm2_tensor_gets_llama_cpp_s_type(mix: str) -> None:
    got, want = smollm2_types(mix), expected(mix)
    assert len(got) == 1 + 7 * LAYERS
    assert {n: t for n, t in got.items() if t != want[n]} == {}


def test_the_table_covers_every_mix() -> None:
    assert set(SMOLLM2) == set(MIXES)


def test_llama_cpp_s_row_length_fallbacks() -> None:
    assert [fitted(t, 576).type for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")] == [
        "Q4_0",
        "Q4_0",
        "Q5_0",
        "Q5_1",
        "Q8_0",
    ]
    assert fitted("Q4_K", 512).type == "Q4_K" and not fitted("Q4_K", 512).fell_back
    assert fitted("Q4_K", 200).type == "F16"  # neither 256 nor 32 divides it


def test_untied_output_and_embedding() -> None:
    m = mix_of("Q4_K_M")
    at = Layer(0, 2)
    assert tensor_type(m, "output.weight", 512, at, tied=False).type == "Q6_K"
    assert tensor_type(m, "output.weight", 576, at, tied=False).type == "Q8_0"
    assert tensor_type(m, "token_embd.weight", 512, at, tied=False).type == "Q4_K"  # the base type, untied
    assert tensor_type(mix_of("Q8_0"), "output.weight", 512, at, tied=False).type == "Q8_0"


def test_gqa_and_70b_rules() -> None:
    assert tensor_type(mix_of("Q2_K"), "blk.3.attn_v.weight", 512, Layer(3, 32, gqa=4), tied=False).type == "Q4_K"
    assert tensor_type(mix_of("Q2_K"), "blk.3.attn_v.weight", 512, Layer(3, 32, gqa=2), tied=False).type == "Q3_K"
    seventy = Layer(40, 80, gqa=8, is_70b=True)
    assert tensor_type(mix_of("Q4_K_M"), "blk.40.attn_v.weight", 8192, seventy, tied=False).type == "Q5_K"
    assert (
        tensor_type(mix_of("Q4_K_M"), "blk.42.attn_v.weight", 8192, Layer(42, 80, 8, True), tied=False).type == "Q6_K"
    )


def test_unknown_mix_names_the_valid_ones() -> None:
    with pytest.raises(QuantkitError, match=r"unknown GGUF mix 'Q4_K_X'.*Q4_K_M.*Q6_K"):
        mix_of("Q4_K_X")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 layers, every width a multiple of 256 (hidden 256, intermediate 512), 8 heads over 2 KV heads (gqa 4)."""
    path = tmp_path_factory.mktemp("wide") / "model"
    model = tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=256)  # fmt: skip
    model.to(torch.bfloat16).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


def test_a_256_wide_model_gets_every_k_type_and_no_fallback(wide_model: Path) -> None:
    seen: set[str] = set()
    with SourceWeights(wide_model) as weights:
        arch = arch_for_dir(wide_model)
        for mix in MIXES.values():
            plan = plan_gguf(weights, arch, mix)
            assert not any(t.choice.fell_back for t in plan)
            seen |= {t.type for t in plan}
        q2 = {t.name: t.type for t in plan_gguf(weights, arch, mix_of("Q2_K"))}
        q3m = {t.name: t.type for t in plan_gguf(weights, arch, mix_of("Q3_K_M"))}
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= seen
    assert q2["blk.5.attn_v.weight"] == "Q4_K"  # gqa 4
    assert q2["blk.5.attn_q.weight"] == "Q2_K" and q2["blk.5.ffn_down.weight"] == "Q3_K"
    assert q2["output.weight"] == "Q6_K" and q2["token_embd.weight"] == "Q2_K"
    assert [q3m[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert q3m["blk.0.ffn_down.weight"] == "Q4_K"  # 8 // 16 == 0 layers get Q5_K
    assert q3m["blk.0.attn_output.weight"] == "Q4_K" and q3m["blk.0.attn_q.weight"] == "Q3_K"
