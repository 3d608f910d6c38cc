"""Folding rotations keeps every supported family's function, refuses norms it cannot fold, and gives the same
weights block by block as for the whole model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers.families import FAMILIES, tiny_model
from helpers.rotation import rotate_model
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from quantkit.errors import QuantkitError
from quantkit.model.architectures import arch_for_model_type
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.rotation import fold
from quantkit.rotation.config import rotations_for
from quantkit.rotation.fold import check_foldable, fold_block, rotate_embedding, rotate_head

HADAMARD = RotationConfig("hadamard", seed=3)
CASES = [(family, tied) for family in FAMILIES for tied in (False, True)]


def _logits(model: PreTrainedModel) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _rotate(model: PreTrainedModel, config: RotationConfig = HADAMARD) -> bool:
    return rotate_model(model, arch_for_model_type(model.config.model_type), config)


@pytest.mark.parametrize(("family", "tied"), CASES)
def test_rotated_model_computes_the_same_logits(family: str, tied: bool) -> None:
    model = tiny_model(family, tied)
    before, original = _logits(model), copy.deepcopy(model.state_dict())
    assert _rotate(model) is tied
    assert _relative_error(_logits(model), before) < 1e-4
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith(("layernorm.weight", "model.norm.weight")):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.equal(tensor, original[name]), name  # per-head norms are untouched
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert not torch.allclose(state[name], original[name], atol=1e-3), name  # something was rotated
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_head_rotation_changes_v_and_o_but_not_the_function() -> None:
    with_heads, without = tiny_model("qwen2", tied=False), tiny_model("qwen2", tied=False)
    before = _logits(with_heads)
    _rotate(with_heads)
    _rotate(without, RotationConfig("hadamard", seed=3, rotate_heads=False))
    assert _relative_error(_logits(without), before) < 1e-4
    attn, plain = with_heads.model.layers[0].self_attn, without.model.layers[0].self_attn
    for name in ("v_proj.weight", "v_proj.bias", "o_proj.weight"):
        assert not torch.allclose(attn.get_parameter(name), plain.get_parameter(name), atol=1e-3), name
    assert torch.equal(attn.q_proj.weight, plain.q_proj.weight)


def test_none_changes_nothing() -> None:
    model = tiny_model("llama", tied=True)
    original = copy.deepcopy(model.state_dict())
    assert _rotate(model, RotationConfig("none")) is False
    assert all(torch.equal(t, original[n]) for n, t in model.state_dict().items())
    assert model.config.tie_word_embeddings is True


def test_untied_head_survives_save_and_load(tmp_path: Path) -> None:
    model = tiny_model("llama", tied=True)
    _rotate(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config.tie_word_embeddings is False
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert torch.equal(_logits(loaded), _logits(model))


class OffsetRMSNorm(nn.Module):
    """Gemma-style: (1 + w) * x / rms(x), which cannot absorb w as a plain scale."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1.0 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize(
    ("path", "replacement", "message"),
    [
        ("input_layernorm", nn.LayerNorm(48), r"'input_layernorm' is a LayerNorm"),
        ("post_attention_layernorm", OffsetRMSNorm(48), r"'post_attention_layernorm' .*\(1 \+ w\)"),
    ],
)
def test_a_norm_that_is_no_rmsnorm_is_refused_by_name(path: str, replacement: nn.Module, message: str) -> None:
    model = tiny_model("llama", tied=False)
    arch = arch_for_model_type("llama")
    setattr(model.model.layers[1], path, replacement)
    with pytest.raises(QuantkitError, match=message):
        check_foldable(model.model.layers[1], arch)
    original = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantkitError, match=path):
        rotate_model(model, arch, HADAMARD)
    assert all(torch.equal(t, original[n]) for n, t in model.state_dict().items())  # refused before any change


def test_layernorm_without_the_class_check_is_caught_by_the_probe() -> None:
    class Wrapped(nn.Module):  # a LayerNorm in disguise, without a bias parameter
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.layer_norm(x, x.shape[-1:], self.weight)

    block = tiny_model("llama", tied=False).model.layers[0]
    block.input_layernorm = Wrapped(48)
    with pytest.raises(QuantkitError, match=r"'input_layernorm' does not commute with a rotation"):
        check_foldable(block, arch_for_model_type("llama"))


def test_a_linear_that_is_not_float_is_refused_by_name() -> None:
    block = tiny_model("llama", tied=False).model.layers[0]
    block.mlp.down_proj.weight = nn.Parameter(block.mlp.down_proj.weight.to(torch.int8), requires_grad=False)
    with pytest.raises(QuantkitError, match=r"'mlp.down_proj'.*before quantizing"):
        check_foldable(block, arch_for_model_type("llama"))


@pytest.mark.parametrize(("family", "tied"), [("qwen2", True), ("qwen3", False)])
def test_block_by_block_folding_matches_the_whole_model(family: str, tied: bool) -> None:
    """As a layer-by-layer pipeline would: each block loaded on its own, the embedding and head separately."""
    source = tiny_model(family, tied)
    arch = arch_for_model_type(family)
    whole = copy.deepcopy(source)
    rotate_model(whole, arch, HADAMARD)
    rotations = rotations_for(HADAMARD, source.config)
    for index, layer in enumerate(source.model.layers):
        block = copy.deepcopy(layer)
        fold_block(block, arch, rotations.residual, rotations.head)
        expected = whole.model.layers[index].state_dict()
        assert all(torch.equal(t, expected[n]) for n, t in block.state_dict().items()), index
    embed = rotate_embedding(source.model.embed_tokens.weight, rotations.residual)
    head = rotate_head(source.lm_head.weight, source.model.norm.weight, rotations.residual)
    assert torch.equal(embed, whole.model.embed_tokens.weight)
    assert torch.equal(head, whole.lm_head.weight)


def test_bfloat16_block_stays_bfloat16_and_close_to_the_float32_fold() -> None:
    model = tiny_model("mistral", tied=False)
    source, arch = model.model.layers[0], arch_for_model_type("mistral")
    rotations = rotations_for(HADAMARD, model.config)
    exact, low = copy.deepcopy(source), copy.deepcopy(source).to(torch.bfloat16)
    fold_block(exact, arch, rotations.residual, rotations.head)
    fold_block(low, arch, rotations.residual, rotations.head)
    for name, tensor in low.state_dict().items():
        assert tensor.dtype == torch.bfloat16, name
        reference = exact.state_dict()[name]
        assert (tensor.float() - reference).abs().max() <= 2**-7 * reference.abs().max(), name


def test_chunked_rotation_matches_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(257, 96, generator=torch.Generator().manual_seed(0))
    norm_weight = torch.rand(96, generator=torch.Generator().manual_seed(1)) + 0.5
    residual = rotations_for(HADAMARD, tiny_model("mistral", tied=False).config).residual
    whole = rotate_head(weight, norm_weight, residual)
    monkeypatch.setattr(fold, "_CHUNK_ELEMENTS", 96 * 5)  # 5 rows a chunk, the last one partial
    assert torch.allclose(rotate_head(weight, norm_weight, residual), whole, rtol=0, atol=1e-6)
    expected = (weight.double() * norm_weight.double()) @ residual
    assert (whole.double() - expected).abs().max() < 1e-6
