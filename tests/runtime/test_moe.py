"""The runtime's sparse mixture-of-experts MLP (qwen3_moe, mixtral, qwen2_moe) against transformers: fp32 logits
within 1e-5, greedy tokens equal to ``generate``, continuous batching equal to one request at a time, the MoE
block bit-exact in bf16 (routing weights cast where transformers casts them), and quantized checkpoints equal to
quantkit's own dequantizing loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.runtime import engine_logits, greedy, hf_logits
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from quantkit.errors import UnsupportedArchitectureError
from quantkit.model.resolve import load_model as load_reference
from quantkit.runtime.engine import Engine
from quantkit.runtime.llm import LLM
from quantkit.runtime.model import ModelConfig, load_model
from quantkit.runtime.moe import SparseMoE

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 71]
_COMMON = dict(
    hidden_size=128,  # vLLM's fused-MoE Marlin kernel tiles the hidden size by 128 (quantize checks it)
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    max_position_embeddings=128,
    num_experts_per_tok=2,
    initializer_range=0.1,  # peaked routing and distinct logits, so a wrong expert or weight shows
)
_FAMILY: dict[str, dict] = {
    # qwen3_moe renormalises its top-k weights here, qwen2_moe keeps transformers' default (no renormalisation)
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=64, shared_expert_intermediate_size=96),
}


def tiny_moe(family: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **_COMMON, **_FAMILY[family])
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    model.set_experts_implementation("eager")  # transformers' reference loop over experts
    return model


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in FAMILIES:
        model = tiny_moe(family)
        model.save_pretrained(root / family)
        out[family] = (model, root / family)
    return out


def _engine(path: Path, **kw) -> Engine:
    return Engine(path, num_kv_blocks=64, block_size=4, max_model_len=128, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(family: str, moe) -> None:
    model, path = moe[family]
    ours, expected = engine_logits(_engine(path), PROMPT), hf_logits(model, PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5, f"{family}: max logit error {error:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_generate(family: str, moe) -> None:
    model, path = moe[family]
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        expected = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    (out,) = LLM(path, num_kv_blocks=64, block_size=4, max_model_len=128).generate(PROMPT, greedy(16))
    assert out.token_ids == expected[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_equals_one_at_a_time(family: str, moe) -> None:
    """Prompts of different lengths in one batch (their tokens routed together) give each prompt's solo tokens."""
    _, path = moe[family]
    prompts = [PROMPT, PROMPT[:3], [5, 900, 12, 44, 7, 300, 8], [2], [1, 17, 42, 99, 400, 401, 402, 403, 404]]
    solo = [LLM(path, num_kv_blocks=64, block_size=4, max_model_len=128).generate(p, greedy(12))[0] for p in prompts]
    batched = LLM(path, num_kv_blocks=64, block_size=4, max_model_len=128, max_num_seqs=8).generate(prompts, greedy(12))
    assert [o.token_ids for o in batched] == [o.token_ids for o in solo]


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_block_is_bit_exact_in_bf16(family: str, tmp_path: Path) -> None:
    """One layer's sparse MLP in bf16 on the same input: the runtime's output equals transformers' exactly, so the
    routing weights are rounded where transformers rounds them (Qwen: cast to bf16 before scaling the expert
    outputs; Mixtral: kept in fp32)."""
    hf = tiny_moe(family, torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    layer = ours.model.layers[0]
    block = getattr(layer, layer.mlp_path)
    assert isinstance(block, SparseMoE)
    x = torch.randn(37, _COMMON["hidden_size"], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(x[None])[0]
        assert torch.equal(block(x), expected)


def test_config_reads_transformers_defaults_and_both_expert_count_keys() -> None:
    """A hand-written config.json omits defaults: the runtime takes transformers' config class defaults (no top-k
    renormalisation for the Qwens, Mixtral's rms_norm_eps 1e-5) and reads num_experts or num_local_experts."""
    base = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100}
    qwen = ModelConfig.from_hf({**base, "model_type": "qwen3_moe", "intermediate_size": 96, "num_local_experts": 4})
    assert qwen.moe is not None
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.renormalize, qwen.moe.path) == (4, 8, False, "mlp")
    mixtral = ModelConfig.from_hf({**base, "model_type": "mixtral", "intermediate_size": 96, "num_experts": 4})
    assert mixtral.moe is not None
    assert (mixtral.moe.num_experts, mixtral.moe.intermediate_size, mixtral.moe.renormalize) == (4, 96, True)
    assert (mixtral.moe.path, mixtral.rms_norm_eps) == ("block_sparse_moe", 1e-5)
    dense = ModelConfig.from_hf({**base, "model_type": "qwen3", "intermediate_size": 96})
    assert dense.moe is None


def test_models_mixing_dense_and_sparse_layers_are_refused(moe) -> None:
    _, path = moe["qwen3_moe"]
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(UnsupportedArchitectureError, match="mlp_only_layers"):
        ModelConfig.from_hf({**cfg, "mlp_only_layers": [0]})


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_checkpoint_matches_quantkit_loader(
    family: str, moe, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``quantkit quantize --method rtn --scheme W4A16``: every expert projection (and the shared expert) takes the
    checkpoint's int4 weights, the router stays float, and the logits equal the dequantizing reference loader's."""
    model, path = moe[family]
    out = tmp_path / "q"
    args = ["quantize", str(path), "-o", str(out), "--method", "rtn", "--scheme", "W4A16", "--group-size", "32"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    engine = _engine(out)
    layer = engine.model.model.layers[0]
    router = getattr(layer, layer.mlp_path).gate.weight
    assert torch.equal(router, model.model.layers[0].mlp.gate.weight)  # written and read in float
    ours, expected = engine_logits(engine, PROMPT), hf_logits(load_reference(out), PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5, f"{family}: max logit error against the reference loader {error:.2e}"
    assert (ours - hf_logits(model, PROMPT)).abs().max() > 1e-3  # the int4 experts were used, not float ones
