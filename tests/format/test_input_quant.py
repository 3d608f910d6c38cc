"""Inputs quantized as the serving kernel computes them: vLLM's per-token scales (``absmax / 127`` for int8,
``absmax / 448`` floored at ``1 / (448 * 512)`` for FP8), static scales as stored, and the grouped float schemes
equal to compressed-tensors' own dynamic quantization (which computes the same numbers in float32)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from quantkit.format.input_quant import fake_quantize_input, static_input_scale
from quantkit.format.presets import PRESETS


def _inputs(rows: int = 6, features: int = 128, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))
    x[1, 3] = 40.0  # an outlier channel: per-token and per-group scales must follow it
    return x


def test_int8_tokens_are_scaled_by_their_absmax_over_127():
    x = _inputs()
    acts = PRESETS["W8A8"].activations
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    expected = (x / scale).round().clamp(-128, 127) * scale
    assert torch.equal(fake_quantize_input(x, acts, None), expected)
    assert float(fake_quantize_input(x, acts, None)[1, 3]) == pytest.approx(40.0)  # the absmax is exact


def test_fp8_tokens_floor_their_scale_so_a_zero_row_stays_zero():
    x = _inputs()
    x[2] = 0.0
    out = fake_quantize_input(x, PRESETS["FP8_DYNAMIC"].activations, None)
    assert torch.equal(out[2], torch.zeros(128))
    scale = x[0].abs().amax() / 448
    assert torch.equal(out[0], (x[0] / scale).to(torch.float8_e4m3fn).float() * scale)


def test_a_static_scheme_uses_the_stored_scale_and_refuses_to_run_without_it():
    x = _inputs()
    acts = PRESETS["FP8"].activations
    scale = static_input_scale(20.0, acts, torch.float32)
    assert float(scale) == pytest.approx(20.0 / 448)
    assert float(fake_quantize_input(x, acts, scale)[1, 3]) == pytest.approx(20.0)  # clipped to the static range
    with pytest.raises(ValueError, match="calibrated input scale"):
        fake_quantize_input(x, acts, None)


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8_BLOCK", "MXFP8", "MXFP4", "W4AFP8"])
def test_dynamic_float_inputs_equal_compressed_tensors(preset):
    x = _inputs().unsqueeze(0)  # [batch, tokens, features]: compressed-tensors' per-token scales keep two dims
    args = PRESET_SCHEMES[preset]["input_activations"]
    scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module())
    theirs = fake_quantize(x=x, scale=scale, zero_point=zero, args=args)
    assert torch.equal(fake_quantize_input(x, PRESETS[preset].activations, None), theirs)


def test_nvfp4_inputs_equal_compressed_tensors_under_the_static_global_scale():
    x = _inputs()
    acts = PRESETS["NVFP4"].activations
    global_scale = static_input_scale(float(x.abs().amax()), acts, torch.float32)
    assert float(global_scale) == pytest.approx(448 * 6 / 40.0)
    args = PRESET_SCHEMES["NVFP4"]["input_activations"]
    scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module(), global_scale=global_scale)
    theirs = fake_quantize(x=x, scale=scale, zero_point=zero, args=args, global_scale=global_scale)
    assert torch.equal(fake_quantize_input(x, acts, global_scale), theirs)
