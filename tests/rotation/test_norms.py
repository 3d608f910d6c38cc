"""check_rmsnorm accepts a norm of the weight offset its architecture declares (w * x / rms(x), or (1 + w) * x / rms(x)
for the norms Gemma and Qwen3.5 store around zero) and refuses one that computes another form, by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

from quantkit.errors import QuantkitError
from quantkit.rotation.norms import check_rmsnorm, norm_scale, unit_weight

HIDDEN = 64


def _randomized(norm: nn.Module, low: float, high: float) -> nn.Module:
    with torch.no_grad():
        norm.weight.uniform_(low, high, generator=torch.Generator().manual_seed(0))
    return norm


class SwappedOffsetNorm(nn.Module):
    """(1 + w) with the weight read in reverse channel order: rms 1 at w = 0, but not a channel-wise (1 + w)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1.0 + self.weight.flip(0)) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("norm_class", [Qwen3_5MoeRMSNorm, Gemma3RMSNorm])
def test_a_one_plus_w_norm_is_accepted_with_offset_one_and_refused_without(norm_class: type[nn.Module]) -> None:
    norm = _randomized(norm_class(HIDDEN), -0.3, 0.3)
    check_rmsnorm(norm, "input_layernorm", offset=1.0)
    with pytest.raises(QuantkitError, match=r"'input_layernorm' does not normalize to rms 1 .*\(a \(1 \+ w\) weight"):
        check_rmsnorm(norm, "input_layernorm", offset=0.0)
    assert norm.weight.abs().max() > 0.1  # the probe ran on a copy: the weight is the one it had


def test_a_plain_norm_declared_with_offset_one_is_refused() -> None:
    norm = _randomized(LlamaRMSNorm(HIDDEN), 0.5, 1.5)
    check_rmsnorm(norm, "model.norm")
    with pytest.raises(QuantkitError, match=r"'model.norm' does not normalize to rms 1 with weight 0 .*w \* x / rms"):
        check_rmsnorm(norm, "model.norm", offset=1.0)


def test_a_norm_that_does_not_scale_by_one_plus_its_own_weight_is_refused() -> None:
    norm = _randomized(SwappedOffsetNorm(), -0.3, 0.3)
    with pytest.raises(QuantkitError, match=r"'post_attention_layernorm' does not scale its output .* by \(1 \+ w\)"):
        check_rmsnorm(norm, "post_attention_layernorm", offset=1.0)


def test_the_folded_norm_multiplies_by_one_and_its_scale_is_exact_in_bfloat16() -> None:
    norm = Qwen3_5MoeRMSNorm(HIDDEN).to(torch.bfloat16)
    _randomized(norm, -0.3, 0.3)
    scale = norm_scale(norm.weight, 1.0)
    assert scale.dtype == torch.float64 and torch.equal(scale, norm.weight.double() + 1.0)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        norm.weight.fill_(unit_weight(1.0))
        assert torch.equal(norm.weight, torch.zeros_like(norm.weight))
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
        assert torch.allclose(norm.float()(x), expected, rtol=1e-6, atol=1e-6)
