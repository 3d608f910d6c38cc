"""Rotations fold into Qwen3.5-MoE's hybrid layers, each under its own layer's spec: a gated DeltaNet layer's
in_proj_qkv/z/b/a read input_layernorm (in_proj_b / in_proj_a kept in float, but folded all the same) and out_proj
writes the residual; a gated full-attention layer's q/k/v read it and o_proj writes it; the MoE reads the post-attention
norm. The norms multiply by 1 + w: their scale goes into the readers and they are stored as zeros. The attention
output is gated elementwise before the output projection, so the per-head rotation is left out."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.qwen3_5_moe import tiny_qwen3_5_moe
from helpers.rotation import rotate_model
from transformers import PreTrainedModel

from quantkit.errors import QuantkitError
from quantkit.model.architectures import ArchSpec, arch_for_config
from quantkit.model.moe import unfuse_experts
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.rotation import fold
from quantkit.rotation.config import rotations_for
from quantkit.rotation.fold import fold_block, head_rotation_refusal

HADAMARD = RotationConfig("hadamard", seed=3)
KINDS = {
    "mixed": ("linear_attention", "full_attention", "linear_attention", "full_attention"),
    "deltanet": ("linear_attention", "linear_attention"),
    "attention": ("full_attention", "full_attention"),
}


def _model(kinds: tuple[str, ...], tied: bool = False) -> tuple[PreTrainedModel, ArchSpec]:
    model = tiny_qwen3_5_moe(layer_types=list(kinds), num_hidden_layers=len(kinds), tie_word_embeddings=tied)
    arch = arch_for_config(model.config.to_dict())
    unfuse_experts(model, arch)  # per-expert linears, as the quantizer folds them
    return model, arch


def _logits(model: PreTrainedModel) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids, use_cache=False).logits  # (a DeltaNet-only cache has no sequence length)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize(
    ("kinds", "tied"), [("mixed", False), ("mixed", True), ("deltanet", False), ("attention", False)]
)
def test_rotated_hybrid_computes_the_same_logits(kinds: str, tied: bool) -> None:
    model, arch = _model(KINDS[kinds], tied)
    before, original = _logits(model), copy.deepcopy(model.state_dict())
    assert rotate_model(model, arch, HADAMARD) is tied
    assert _relative_error(_logits(model), before) < 1e-4
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")):
            assert torch.equal(tensor, torch.zeros_like(tensor)), name  # (1 + 0): multiply by one
        elif name.endswith(("q_norm.weight", "k_norm.weight", "linear_attn.norm.weight")):
            assert torch.equal(tensor, original[name]), name  # per-head norms are untouched
    for index in range(len(KINDS[kinds])):
        layer = arch.for_layer(index)
        for linear in (*layer.linears, *layer.float_linears):  # every reader and writer of the residual turned
            name = f"model.layers.{index}.{linear}.weight"
            assert not torch.allclose(state[name], original[name], atol=1e-3), name
    assert not torch.allclose(state["lm_head.weight"], original["lm_head.weight"], atol=1e-3)


def test_the_deltanet_float_gates_fold_behind_the_input_norm_and_the_router_behind_the_post_attention_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W' = (W ⊙ (1 + w_norm)) Q with each linear's own norm; folding in_proj_b / in_proj_a behind the
    post-attention norm (as the router is) changes the function."""
    model, arch = _model(KINDS["mixed"])
    residual = rotations_for(HADAMARD, model.config).residual
    layer = model.model.layers[0]
    expected = {
        path: (layer.get_submodule(path).weight.double() * (1.0 + layer.get_submodule(norm).weight.double())) @ residual
        for path, norm in (
            ("linear_attn.in_proj_b", "input_layernorm"),
            ("linear_attn.in_proj_a", "input_layernorm"),
            ("mlp.gate", "post_attention_layernorm"),
            ("mlp.shared_expert_gate", "post_attention_layernorm"),
        )
    }
    block = copy.deepcopy(layer)
    fold_block(block, arch.for_layer(0), residual)
    for path, weight in expected.items():
        assert (block.get_submodule(path).weight.double() - weight).abs().max() < 1e-6, path

    right, gates = fold._norm_readers, ("linear_attn.in_proj_b", "linear_attn.in_proj_a")

    def every_float_linear_behind_norms_1(spec: ArchSpec) -> tuple[tuple[str, tuple[str, ...]], ...]:
        (first, readers), (second, mlp) = right(spec)
        return (first, tuple(r for r in readers if r not in gates)), (
            second,
            mlp + tuple(g for g in gates if g in readers),
        )

    before = _logits(model)
    monkeypatch.setattr(fold, "_norm_readers", every_float_linear_behind_norms_1)  # the mapping before hybrids
    rotate_model(model, arch, HADAMARD)
    assert _relative_error(_logits(model), before) > 1e-3


def test_the_head_rotation_is_left_out_for_the_gated_attention_output() -> None:
    model, arch = _model(KINDS["attention"])
    assert head_rotation_refusal(arch) is not None and "gate" in head_rotation_refusal(arch)
    assert head_rotation_refusal(arch_for_config({"model_type": "llama"})) is None
    rotations = rotations_for(HADAMARD, model.config)
    assert rotations.head is not None  # asked for: the fold refuses it for this family
    with pytest.raises(QuantkitError, match=r"cannot rotate attention heads: qwen3_5_moe multiplies each attention"):
        fold_block(model.model.layers[0], arch.for_layer(0), rotations.residual, rotations.head)
    # the per-head rotation would change the function: the gate is elementwise on each head's output
    block = model.model.layers[0]
    before = _logits(model)
    with torch.no_grad():
        fold._rotate_heads(block, arch.for_layer(0), rotations.head)
    assert _relative_error(_logits(model), before) > 1e-3


def test_a_hybrid_block_needs_its_layers_spec() -> None:
    model, arch = _model(KINDS["mixed"])
    residual = rotations_for(HADAMARD, model.config).residual
    with pytest.raises(AssertionError, match="for_layer"):
        fold_block(model.model.layers[0], arch, residual)
    with pytest.raises(QuantkitError, match=r"no module 'self_attn.q_proj'"):  # a DeltaNet layer under the other spec
        fold_block(model.model.layers[0], arch.for_layer(1), residual)
