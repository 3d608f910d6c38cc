"""The compressed-tensors formats that store one code per byte as ``weight`` itself: ``int-quantized`` (INT8 codes,
with quantized activations), ``float-quantized`` (FP8 E4M3 codes, with quantized activations), ``naive-quantized``
(FP8 codes, 16-bit activations) and ``mxfp8-quantized`` (FP8 codes under E8M0 group scales).

Tensors of one quantized Linear (N out, K in, G groups):

- ``weight``        int8 or float8_e4m3fn [N, K]
- ``weight_scale``  the model's dtype: [1] per tensor, [N, 1] per channel, [N, G] per group, [ceil(N/b), G] per
                    b x b block; uint8 [N, K/32] biased exponents for MXFP8
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.errors import QuantkitError
from quantkit.format.float_codes import E8M0_BIAS, e8m0_value
from quantkit.format.layouts.base import SCALE, Layout, Part, expanded_rows, stored_rows, stored_scale_shape
from quantkit.format.scheme import QuantizedWeight, QuantScheme

WEIGHT = "weight"


def e8m0_exponents(scale: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents of power-of-two scales (an error for any other value)."""
    exponent = torch.log2(scale.float())
    if not torch.equal(exponent, exponent.round()):
        raise QuantkitError("MX scales must be powers of two; the weight was not quantized for an MX format")
    return (exponent + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS).to(torch.uint8)


class Unpacked(Layout):
    def __init__(self, format: str) -> None:
        self.format = format

    def _scale_part(self, scheme: QuantScheme, n: int, k: int, scale_dtype: torch.dtype) -> Part:
        dtype = torch.uint8 if scheme.scale_format == "e8m0" else scale_dtype
        return Part(SCALE, stored_scale_shape(scheme, n, k), dtype)

    def weight_parts(self, scheme: QuantScheme, n: int, k: int, scale_dtype: torch.dtype) -> list[Part]:
        return [Part(WEIGHT, (n, k), scheme.code_dtype), self._scale_part(scheme, n, k, scale_dtype)]

    def shape_of(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme) -> tuple[int, int]:
        weight = tensors.get(WEIGHT)
        if weight is None or weight.ndim != 2:
            raise QuantkitError(f"checkpoint tensor {WEIGHT!r} is missing or not 2-D; re-export the checkpoint")
        return int(weight.shape[0]), int(weight.shape[1])

    def write_weight(self, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        scheme = qw.scheme
        if qw.zero is not None or qw.g_idx is not None:
            raise QuantkitError(
                f"{self.format} stores symmetric weights in their own column order; {scheme.name} has zero points "
                "or act-order groups: use a symmetric scheme with static groups"
            )
        n, k = qw.shape
        stored = stored_rows(qw.scale, scheme, n, k)
        scale = e8m0_exponents(stored) if scheme.scale_format == "e8m0" else stored.to(scale_dtype)
        return {WEIGHT: qw.qweight.to(scheme.code_dtype).contiguous(), SCALE: scale.contiguous()}

    def read_weight(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, n: int, k: int) -> QuantizedWeight:
        stored = tensors[SCALE]
        scale = e8m0_value(stored) if scheme.scale_format == "e8m0" else stored.float()
        return QuantizedWeight(tensors[WEIGHT], expanded_rows(scale, scheme, n), None, None, scheme)
