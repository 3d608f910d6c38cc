"""The compressed-tensors formats of FP4 E2M1 weights, two codes per byte: ``nvfp4-pack-quantized`` (groups of 16
under FP8 scales and a float32 global scale) and ``mxfp4-pack-quantized`` (groups of 32 under E8M0 scales).

Tensors of one quantized Linear (N out, K in, K even, G groups):

- ``weight_packed``        uint8 [N, K/2]   the first code of each pair in the low nibble
                                            (:func:`quantkit.format.float_codes.pack_fp4`)
- ``weight_scale``         float8_e4m3fn [N, G] (NVFP4, ``scale * global_scale``) or uint8 [N, G] biased exponents (MX)
- ``weight_global_scale``  float32 [1]      NVFP4 only
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.errors import QuantkitError
from quantkit.format.float_codes import e8m0_value, pack_fp4, unpack_fp4
from quantkit.format.layouts.base import SCALE, Layout, Part
from quantkit.format.layouts.unpacked import e8m0_exponents
from quantkit.format.scheme import QuantizedWeight, QuantScheme

PACKED = "weight_packed"
GLOBAL = "weight_global_scale"


class PackedFP4(Layout):
    def __init__(self, format: str) -> None:
        self.format = format

    def weight_parts(self, scheme: QuantScheme, n: int, k: int, scale_dtype: torch.dtype) -> list[Part]:
        nv = scheme.scale_format == "fp8"
        groups = scheme.num_groups(k)
        parts = [
            Part(PACKED, (n, k // 2), torch.uint8),
            Part(SCALE, (n, groups), torch.float8_e4m3fn if nv else torch.uint8),
        ]
        return [*parts, Part(GLOBAL, (1,), torch.float32)] if nv else parts

    def shape_of(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme) -> tuple[int, int]:
        packed = tensors.get(PACKED)
        if packed is None or packed.ndim != 2:
            raise QuantkitError(f"checkpoint tensor {PACKED!r} is missing or not 2-D; re-export the checkpoint")
        return int(packed.shape[0]), 2 * int(packed.shape[1])

    def write_weight(self, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        scheme = qw.scheme
        k = qw.shape[1]
        if k % 2 or k % scheme.group_size:
            raise QuantkitError(f"{self.format} needs in-features divisible by {scheme.group_size}, not {k}")
        out = {PACKED: pack_fp4(qw.qweight.float())}
        if scheme.scale_format == "e8m0":
            out[SCALE] = e8m0_exponents(qw.scale)
            return out
        if qw.global_scale is None:
            raise QuantkitError("an NVFP4 weight needs its global scale")
        stored = (qw.scale * qw.global_scale).to(torch.float8_e4m3fn)
        if not torch.equal(stored.float() / qw.global_scale, qw.scale):
            raise QuantkitError("NVFP4 scales are not FP8 values under the global scale; re-quantize the weight")
        out[SCALE] = stored
        out[GLOBAL] = qw.global_scale.reshape(1).float().clone()  # linears of one fused projection share it
        return out

    def read_weight(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, n: int, k: int) -> QuantizedWeight:
        codes = unpack_fp4(tensors[PACKED]).to(torch.float8_e4m3fn)
        if scheme.scale_format == "e8m0":
            return QuantizedWeight(codes, e8m0_value(tensors[SCALE]), None, None, scheme)
        global_scale = tensors[GLOBAL].float().reshape(1)
        scale = tensors[SCALE].float() / global_scale
        return QuantizedWeight(codes, scale, None, None, scheme, global_scale=global_scale)
