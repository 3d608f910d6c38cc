"""Rotations fold into the blocks beyond the Llama shape: Phi-3's fused qkv_proj (the value rows are its last
kv_heads x head_dim rows) and gate_up_proj, and mixture-of-experts blocks (the router and every expert's
down_proj): the rotated model computes the same logits."""

from __future__ import annotations

import pytest
import torch
from helpers.moe import MOE_FAMILIES, tiny_moe
from helpers.rotation import rotate_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from quantkit.model.architectures import arch_for_config
from quantkit.model.moe import unfuse_experts
from quantkit.quantization.methods.rotation import RotationConfig

HADAMARD = RotationConfig("hadamard", seed=3)


def _logits(model: PreTrainedModel) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def tiny_phi3(seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "phi3", hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, vocab_size=256, max_position_embeddings=64, initializer_range=0.1,
        tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("family", ["phi3", *MOE_FAMILIES])
def test_rotated_block_computes_the_same_logits(family: str) -> None:
    model = tiny_phi3() if family == "phi3" else tiny_moe(family)
    arch = arch_for_config(model.config.to_dict())
    unfuse_experts(model, arch)
    before = _logits(model)
    layer = model.model.layers[0]
    first = dict(layer.named_parameters())
    original = {name: p.detach().clone() for name, p in first.items()}
    rotate_model(model, arch, HADAMARD)
    after = _logits(model)
    assert ((after - before).abs().max() / before.abs().max()).item() < 1e-4
    rotated = {name for name, p in layer.named_parameters() if not torch.allclose(p, original[name], atol=1e-3)}
    for name in (*arch.linears, *arch.float_linears):
        assert f"{name}.weight" in rotated, name  # every linear reading or writing the residual stream turned
