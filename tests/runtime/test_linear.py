"""The runtime's Linear on every checkpoint format against the format's own QuantLinear: the buffers it loads are
the layout's parts, the dense weight it keeps is QuantLinear's, its output (input quantization included) is
QuantLinear's; linears sharing an input fuse only when their inputs quantize alike."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import rtn_for_tests

from quantkit.format.input_quant import static_input_scale
from quantkit.format.presets import PRESETS
from quantkit.format.quant_linear import QuantLinear
from quantkit.format.scheme import QuantizedWeight
from quantkit.format.tensors import linear_parts, linear_tensors
from quantkit.runtime.linear import Linear, fuse_linears, takes_kernel

N, K = 48, 128  # K: a multiple of every preset's group and block


def _quantized(preset: str, seed: int, input_absmax: float = 3.0) -> QuantizedWeight:
    scheme = PRESETS[preset]
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    qw = rtn_for_tests(weight, scheme, scale_dtype=torch.float32)
    if scheme.activations is not None and scheme.activations.dynamic is not True:  # a calibrated static scale
        qw.input_scale = static_input_scale(input_absmax, scheme.activations, torch.float32)
    return qw


def _runtime_linear(qw: QuantizedWeight, bias: torch.Tensor) -> Linear:
    with torch.device("meta"):
        layer = Linear(K, N, bias=True)
        layer.quantize(qw.scheme, torch.float32)
    state = {**linear_tensors("", qw, torch.float32), "bias": bias}
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


@pytest.mark.parametrize("preset", list(PRESETS))
def test_linear_holds_the_layout_parts_and_computes_as_quant_linear(preset: str) -> None:
    qw, bias = _quantized(preset, 0), torch.randn(N)
    layer = _runtime_linear(qw, bias)
    parts = {p.name: (p.shape, p.dtype) for p in linear_parts(qw.scheme, N, K, torch.float32)}
    held = {name: (tuple(t.shape), t.dtype) for name, t in layer.named_buffers()}
    assert held == parts
    reference = QuantLinear.from_quantized(qw, bias, scale_dtype=torch.float32)
    layer.prepare(torch.float32, use_kernel=False)
    assert layer.is_dense and not list(layer.buffers())
    assert torch.equal(layer.weight, reference.dense_weight(torch.float32))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)) * 2
    assert torch.equal(layer(x), reference(x))
    assert (layer.input_quant is not None) == (qw.scheme.activations is not None)


def test_only_integer_weight_only_layers_keep_the_packed_kernel_path() -> None:
    kernel = {name for name, scheme in PRESETS.items() if takes_kernel(scheme)}
    assert kernel == {"W4A16", "W4A16_ASYM", "W8A16"}


@pytest.mark.parametrize("preset", ["FP8", "NVFP4", "FP8_DYNAMIC"])
def test_linears_fuse_only_when_their_inputs_quantize_alike(preset: str) -> None:
    static = PRESETS[preset].activations.dynamic is not True  # type: ignore[union-attr]
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(2)) * 2
    for absmax in (3.0, 5.0):  # the second linear's calibrated input range: equal, then larger
        qws = [_quantized(preset, 0), _quantized(preset, 1, input_absmax=absmax)]
        layers = [_runtime_linear(qw, torch.zeros(N)) for qw in qws]
        for layer in layers:
            layer.prepare(torch.float32, use_kernel=False)
        separate = torch.cat([layer(x) for layer in layers], dim=-1)
        fused = fuse_linears(layers)
        if static and absmax != 3.0:
            assert fused is None  # each keeps its own input scale, as the checkpoint says
            continue
        assert fused is not None and fused.input_quant is not None
        assert torch.allclose(fused(x), separate, atol=1e-5, rtol=0)
