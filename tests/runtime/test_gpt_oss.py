"""The runtime serves gpt-oss on the torch backend: attention sinks, q/k/v/o biases, alternating sliding-window and
full layers, YaRN rotary, a biased router softmaxed over its top-k logits and biased experts with the clamped
SwiGLU. fp32 logits within 1e-5 of transformers' and greedy tokens equal to ``generate`` on the float model (prompt
and generation longer than the window); a quantized checkpoint's logits equal quantkit's dequantizing loader's;
transformers cannot load the per-expert checkpoint (shown from what it reports); the hub's MXFP4 layout is served
decoded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.cli import cli_exit_code
from helpers.gpt_oss import CONFIG, WINDOW, save_tiny_gpt_oss, save_tiny_mxfp4_gpt_oss, tiny_gpt_oss
from helpers.runtime import engine_logits, greedy, hf_logits, paged_meta, small_engine, small_llm
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config, PreTrainedModel
from transformers.models.gpt_oss import modeling_gpt_oss

from quantkit.model.resolve import load_model as load_reference
from quantkit.runtime.attention_backend import attend
from quantkit.runtime.layers import RopeConfig, RotaryEmbedding
from quantkit.runtime.model import ModelConfig
from quantkit.runtime.moe import SparseMoE

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 71, 9, 200]  # longer than the sliding window (8)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    path = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "model")
    model = tiny_gpt_oss()
    model.set_experts_implementation("eager")  # transformers' reference loop over experts
    return model, path


def test_config_reads_the_families_differences(gpt_oss: tuple[PreTrainedModel, Path]) -> None:
    _, path = gpt_oss
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert cfg.moe is not None and cfg.moe.swiglu == (1.702, 1.0) and cfg.moe.top_k == 2
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.o_bias
    assert [cfg.window(i) for i in range(2)] == [WINDOW, None]  # sliding, then full
    assert cfg.rope.rope_type == "yarn" and cfg.rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


def test_yarn_tables_equal_transformers() -> None:
    config = AutoConfig.for_model("gpt_oss", **CONFIG)
    theirs = modeling_gpt_oss.GptOssRotaryEmbedding(config)
    positions = torch.arange(200)[None]
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(int(CONFIG["head_dim"]), RopeConfig.from_hf(config.to_dict()))  # type: ignore[arg-type]
    ours.build(200, "cpu")
    assert ours.cos is not None and ours.sin is not None
    half = cos.shape[-1]  # transformers keeps one half; the runtime's table repeats it (neox layout)
    assert torch.equal(ours.cos[:, :half], cos[0]) and torch.equal(ours.sin[:, half:], sin[0])


def test_attention_with_sinks_equals_transformers_eager() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 16, generator=gen) for _ in range(3))
    sinks = torch.randn(4, generator=gen)
    mask = torch.ones(10, 10, dtype=torch.bool).tril() & ~torch.ones(10, 10, dtype=torch.bool).tril(-WINDOW)
    additive = torch.zeros(10, 10).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 1, sinks, False
    expected, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, additive, 0.25)
    got = attend(q, k, v, mask, 0.25, sinks=sinks.view(-1, 1, 1))
    assert torch.allclose(got.transpose(1, 2), expected, atol=1e-6, rtol=0)
    plain = attend(q, k, v, mask, 0.25)
    assert (got - plain).abs().max() > 1e-3  # the sinks take a share of every row's weight


def test_fp32_logits_match_transformers(gpt_oss: tuple[PreTrainedModel, Path]) -> None:
    model, path = gpt_oss
    engine = small_engine(path)
    block = engine.model.model.layers[0].mlp
    assert isinstance(block, SparseMoE) and block.router_linear().bias is not None
    ours, expected = engine_logits(engine, PROMPT), hf_logits(model, PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5 * expected.abs().max().item(), f"max logit error {error:.2e}"


def test_greedy_tokens_match_generate(gpt_oss: tuple[PreTrainedModel, Path]) -> None:
    model, path = gpt_oss
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        expected = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    (out,) = small_llm(path).generate(PROMPT, greedy(16))
    assert out.token_ids == expected[0, len(PROMPT) :].tolist()


def test_continuous_batching_equals_one_at_a_time(gpt_oss: tuple[PreTrainedModel, Path]) -> None:
    _, path = gpt_oss
    prompts = [PROMPT, PROMPT[:3], [5, 90, 12, 44, 7, 30, 8, 11, 250, 3], [2]]
    solo = [small_llm(path).generate(p, greedy(12))[0] for p in prompts]
    batched = small_llm(path, max_num_seqs=8).generate(prompts, greedy(12))
    assert [o.token_ids for o in batched] == [o.token_ids for o in solo]


@pytest.fixture(scope="module")
def quantized(gpt_oss: tuple[PreTrainedModel, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path = gpt_oss
    out = tmp_path_factory.mktemp("gpt_oss_q") / "q"
    args = ["quantize", str(path), "-o", str(out), "--method", "rtn", "--scheme", "W4A16", "--group-size", "32"]
    assert cli_exit_code(args) == 0
    return out


def test_quantized_checkpoint_matches_quantkit_loader(gpt_oss: tuple[PreTrainedModel, Path], quantized: Path) -> None:
    model, _ = gpt_oss
    engine = small_engine(quantized)
    block = engine.model.model.layers[1].mlp
    assert torch.equal(block.router_linear().bias, model.model.layers[1].mlp.router.bias)  # float, as written
    ours, expected = engine_logits(engine, PROMPT), hf_logits(load_reference(quantized), PROMPT)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5 * expected.abs().max().item(), f"max logit error against the reference loader {error:.2e}"
    assert (ours - hf_logits(model, PROMPT)).abs().max() > 1e-3  # the int4 experts were used, not float ones
    (got,) = small_llm(quantized).generate(PROMPT, greedy(12))
    reference = load_reference(quantized)
    with torch.no_grad():
        ids = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.token_ids == ids[0, len(PROMPT) :].tolist()


def test_transformers_cannot_load_per_expert_gpt_oss_checkpoints(quantized: Path) -> None:
    """transformers 5.22 has no weight-conversion rule for gpt_oss (conversion_mapping.py names none): its
    GptOssExperts keeps fused gate_up_proj / down_proj parameters, so the checkpoint's per-expert linears are
    unexpected keys and the fused experts are left uninitialised. quantkit's loader is the way to read it."""
    _, info = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32, output_loading_info=True)
    missing = {k for k in info["missing_keys"] if ".experts." in k}
    assert "model.layers.0.mlp.experts.gate_up_proj" in missing
    unexpected = " ".join(info["unexpected_keys"])
    assert ".mlp.experts.0.gate_proj" in unexpected


def test_the_triton_backend_decodes_sink_layers_in_torch(
    gpt_oss: tuple[PreTrainedModel, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged-attention kernel has no sink term: a gpt_oss layer decodes through the torch path there (the
    kernel is never reached, so this runs without a GPU or Triton's interpreter)."""
    import quantkit.runtime.attention_backend as backend

    seen: list[torch.Tensor | None] = []
    original = backend.torch_decode

    def spy(*args: object) -> torch.Tensor:
        seen.append(args[6])  # type: ignore[arg-type]
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "torch_decode", spy)
    _, path = gpt_oss
    attention = small_engine(path).model.model.layers[0].self_attn  # its kv cache set up by the engine's runner
    meta = paged_meta(False, [[0]], [2], [1], 4)  # one sequence, 3 tokens in the cache
    q = torch.randn(1, attention.num_heads, attention.head_dim)
    out = backend.TritonAttentionBackend().decode(q, attention.kv, meta, 0.1, None, None, attention.sinks)
    assert len(seen) == 1 and seen[0] is attention.sinks and out.shape == q.shape


def test_the_hubs_mxfp4_layout_is_served_decoded(tmp_path: Path) -> None:
    """A checkpoint with MXFP4 experts (as openai/gpt-oss-20b ships) is served with its experts decoded to the
    compute dtype: logits and greedy tokens equal transformers' on its own dequantization."""
    path = save_tiny_mxfp4_gpt_oss(tmp_path / "mxfp4")
    reference = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    reference = reference.to(torch.float32).eval()  # transformers dequantizes the experts to bf16 (exact values)
    reference.set_experts_implementation("eager")
    ours, expected = engine_logits(small_engine(path), PROMPT), hf_logits(reference, PROMPT)
    assert (ours - expected).abs().max().item() < 1e-5 * expected.abs().max().item()
    with torch.no_grad():
        ids = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    (out,) = small_llm(path).generate(PROMPT, greedy(12))
    assert out.token_ids == ids[0, len(PROMPT) :].tolist()
