"""The runtime serves Qwen3.5-MoE (qwen3_5_moe_text) on the torch backend: gated DeltaNet layers with a state slot per
running sequence beside the paged KV cache of the gated full-attention layers (partial rotary, q/k norms around
zero, sigmoid output gate), experts with a shared expert. fp32 logits within 1e-5 of transformers'; greedy tokens
equal to ``generate`` for prompts of different lengths batched together, with chunked prefill and with preemption;
slots freed; prefix caching off and speculative decoding refused; a quantkit RTN W4 checkpoint served as quantkit's
loader computes it, and a rotated one (norms stored as zeros: 1 + 0) as transformers computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli import cli_exit_code
from helpers.qwen3_5_moe import save_tiny_qwen3_5_moe, tiny_qwen3_5_moe
from helpers.runtime import SMALL_CACHE, engine_logits, greedy, hf_logits, small_engine, small_llm
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from quantkit.errors import QuantkitError
from quantkit.model.resolve import load_model as load_reference
from quantkit.runtime.deltanet import GatedDeltaNet
from quantkit.runtime.engine import Engine
from quantkit.runtime.gated_delta import CHUNK, chunked_rule, recurrent_rule
from quantkit.runtime.llm import LLM
from quantkit.runtime.state_slots import StateSlotBlockManager

LONG = [(7 * i + 3) % 250 + 3 for i in range(CHUNK + 13)]  # two chunks of the chunked delta rule
PROMPTS = [LONG[:9], LONG, [5, 90, 12], [2], LONG[20:51]]


def _generate(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path, list[list[int]]]:
    path = save_tiny_qwen3_5_moe(tmp_path_factory.mktemp("qwen3_5_moe") / "model")
    model = tiny_qwen3_5_moe()
    return model, path, [_generate(model, p, 10) for p in PROMPTS]


def test_the_delta_rules_chunked_form_equals_the_recurrent_one_and_continues_from_a_state() -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, dk, dv = 2 * CHUNK + 9, 3, 8, 5
    q, k = torch.randn(n, heads, dk, generator=gen), torch.randn(n, heads, dk, generator=gen)
    v = torch.randn(n, heads, dv, generator=gen)
    g, beta = -torch.rand(n, heads, generator=gen), torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    whole, end = chunked_rule(q, k, v, g, beta, state)
    steps, end_steps = recurrent_rule(q[None], k[None], v[None], g[None], beta[None], state[None])
    assert torch.allclose(whole, steps[0], atol=1e-4) and torch.allclose(end, end_steps[0], atol=1e-4)
    cut = 37  # a prefill split by the scheduler: the second part starts from the first part's state
    first, mid = chunked_rule(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state)
    second, end_split = chunked_rule(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], mid)
    assert torch.allclose(torch.cat((first, second)), whole, atol=1e-4) and torch.allclose(end_split, end, atol=1e-4)
    assert (whole - chunked_rule(q, k, v, g, beta, None)[0]).abs().max() > 1e-2  # the initial state counts


def test_fp32_logits_match_transformers(qwen: tuple[PreTrainedModel, Path, list[list[int]]]) -> None:
    model, path, _ = qwen
    engine = small_engine(path)
    layers = engine.model.model.layers
    assert [layer.mixer for layer in layers] == ["linear_attn", "self_attn", "linear_attn", "self_attn"]
    assert isinstance(layers[0].linear_attn, GatedDeltaNet) and layers[0].linear_attn.qkvz is not None  # fused
    assert engine.runner.cache.values.shape[1] == 2  # KV pages for the two full-attention layers only
    for prompt in (PROMPTS[0], LONG):
        ours, expected = engine_logits(engine, prompt), hf_logits(model, prompt)
        error = (ours - expected).abs().max().item()
        assert error < 1e-5 * expected.abs().max().item(), f"max logit error {error:.2e} ({len(prompt)} tokens)"


def test_batched_greedy_tokens_equal_generate_and_slots_are_freed(
    qwen: tuple[PreTrainedModel, Path, list[list[int]]],
) -> None:
    """Five prompts of 1 to 77 tokens prefilled and decoded in one batch: no state leaks between sequences."""
    _, path, expected = qwen
    llm = small_llm(path, max_num_seqs=8)
    outputs = llm.generate(PROMPTS, greedy(10))
    assert [o.token_ids for o in outputs] == expected
    manager = llm.engine.block_manager
    assert isinstance(manager, StateSlotBlockManager) and not manager.enable_prefix_caching
    assert sorted(manager._free_slots) == list(range(8)) and not manager._slots


def test_chunked_prefill_continues_each_sequences_state(qwen: tuple[PreTrainedModel, Path, list[list[int]]]) -> None:
    _, path, expected = qwen
    llm = LLM(path, **SMALL_CACHE, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=16)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(10))] == expected


def test_preempted_sequences_recompute_from_zero_state(qwen: tuple[PreTrainedModel, Path, list[list[int]]]) -> None:
    """A cache of 30 blocks of 4 tokens cannot hold all five sequences to the end: some are preempted, sent back to
    waiting and re-prefilled (their slot freed and taken again); their tokens are unchanged."""
    _, path, expected = qwen
    llm = LLM(path, num_kv_blocks=30, block_size=4, max_model_len=128, max_num_seqs=8)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(10))] == expected
    assert llm.engine.num_preemptions > 0


def test_speculative_decoding_is_refused_in_one_line(qwen: tuple[PreTrainedModel, Path, list[list[int]]]) -> None:
    _, path, _ = qwen
    with pytest.raises(QuantkitError, match=r"^speculative decoding is not supported for qwen3_5_moe_text: [^\n]*$"):
        Engine(path, **SMALL_CACHE, speculative="ngram")


@pytest.fixture(scope="module")
def quantized(qwen: tuple[PreTrainedModel, Path, list[list[int]]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path, _ = qwen
    out = tmp_path_factory.mktemp("qwen3_5_moe_q") / "q"
    args = ["quantize", str(path), "-o", str(out), "--method", "rtn", "--scheme", "W4A16", "--group-size", "32"]
    assert cli_exit_code(args) == 0
    return out


def test_quantized_checkpoint_matches_quantkit_loader(
    qwen: tuple[PreTrainedModel, Path, list[list[int]]], quantized: Path
) -> None:
    model, _, _ = qwen
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    prefix = "model.layers.0.linear_attn"
    assert {f"{prefix}.in_proj_qkv.weight_packed", f"{prefix}.in_proj_z.weight_packed"} <= names  # int4
    assert {f"{prefix}.in_proj_b.weight", f"{prefix}.in_proj_a.weight"} <= names  # kept in float
    engine = small_engine(quantized)
    reference = load_reference(quantized)
    ours, expected = engine_logits(engine, LONG), hf_logits(reference, LONG)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5 * expected.abs().max().item(), f"max logit error against the reference loader {error:.2e}"
    assert (ours - hf_logits(model, LONG)).abs().max() > 1e-3  # the int4 weights were used, not float ones
    outputs = small_llm(quantized, max_num_seqs=8).generate(PROMPTS, greedy(8))
    assert [o.token_ids for o in outputs] == [_generate(reference, p, 8) for p in PROMPTS]


def test_rotated_checkpoint_serves_as_transformers_computes_it(
    qwen: tuple[PreTrainedModel, Path, list[list[int]]], tmp_path: Path
) -> None:
    """--rotate hadamard writes every block norm and the final norm as zeros (the norm multiplies by 1 + w): the
    runtime reads them as transformers does, logits within 1e-5 and greedy tokens equal to its generate."""
    _, path, _ = qwen
    out = tmp_path / "r"
    args = ["quantize", str(path), "-o", str(out), "--method", "rtn", "--scheme", "W4A16", "--group-size", "32"]
    assert cli_exit_code([*args, "--rotate", "hadamard"]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert (
            not f.get_tensor("model.layers.0.input_layernorm.weight").any()
            and not f.get_tensor("model.norm.weight").any()
        )
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, expected = engine_logits(small_engine(out), LONG), hf_logits(reference, LONG)
    error = (ours - expected).abs().max().item()
    assert error < 1e-5 * expected.abs().max().item(), f"max logit error against transformers {error:.2e}"
    outputs = small_llm(out, max_num_seqs=8).generate(PROMPTS, greedy(8))
    assert [o.token_ids for o in outputs] == [_generate(reference, p, 8) for p in PROMPTS]
