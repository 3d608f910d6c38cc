"""The small float formats agree bit for bit with compressed-tensors' own rounding, packing and MX scales."""

from __future__ import annotations

import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

from quantkit.format.float_codes import (
    e8m0_value,
    mx_scale_exponent,
    pack_fp4,
    round_fp4,
    round_fp8,
    unpack_fp4,
)


def _values(seed: int = 0, n: int = 4096) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 7.0, -9.0, 0.0, -0.1])
    return torch.cat([x, ties])


def test_fp4_rounding_is_compressed_tensors():
    x = _values()
    assert torch.equal(round_fp4(x), FP4_E2M1_DATA.cast_to_fp4(x.clone()))


def test_fp4_packing_is_compressed_tensors_byte_for_byte():
    values = round_fp4(_values(1, 64 * 32)[: 64 * 32].reshape(64, 32))
    ours = pack_fp4(values)
    assert torch.equal(ours, pack_fp4_to_uint8(values))
    assert torch.equal(unpack_fp4(ours), unpack_fp4_from_uint8(ours, 64, 32, dtype=torch.float32))
    assert torch.equal(unpack_fp4(ours).abs(), values.abs())


def test_fp8_rounding_is_torchs_cast():
    x = _values(2) * 100
    assert torch.equal(round_fp8(x), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_mx_scales_are_compressed_tensors():
    absmax = torch.rand(1000, generator=torch.Generator().manual_seed(3)) * 10 + 1e-3
    for bits in (4, 8):
        expected = generate_mx_scales(absmax.clone(), num_bits=bits).to(torch.int32)
        assert torch.equal(mx_scale_exponent(absmax, bits), expected)
    assert float(e8m0_value(torch.tensor([127, 128, 126]))[2]) == 0.5
