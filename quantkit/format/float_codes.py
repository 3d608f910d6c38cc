"""The small floating-point number formats of the float presets, as compressed-tensors stores them.

- FP8 E4M3 (``torch.float8_e4m3fn``): values up to 448; rounding is torch's cast (to nearest, ties to even).
- FP4 E2M1: the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; rounding to nearest with ties to the even
  mantissa, as compressed-tensors' ``cast_to_fp4``. Stored as 4-bit codes (sign in bit 3, then the index of the
  magnitude in :data:`FP4_VALUES`), two per byte along the row, the first of each pair in the low nibble.
- E8M0 scales (the MX formats): a power of two stored as its exponent plus 127 in one byte.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP4_MAX = 6.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes, in code order
# rounding thresholds between neighbouring magnitudes, and whether a value equal to one rounds up (ties to even)
_FP4_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E8M0_BIAS = 127
MX_GROUP = 32  # elements per E8M0 scale in the MX formats
NV_GROUP = 16  # elements per FP8 scale in NVFP4
MX_ELEMENT_EMAX = {4: 2, 8: 8}  # floor(log2(largest element)): E2M1's 6, E4M3's 448


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to FP8 E4M3 values (clamped to +-448), in ``x``'s dtype."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def round_fp4(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to FP4 E2M1 values (clamped to +-6), in ``x``'s dtype."""
    magnitude = x.abs()
    out = torch.zeros_like(magnitude)
    for (threshold, tie_up), value in zip(_FP4_STEPS, FP4_VALUES[1:], strict=True):
        above = magnitude >= threshold if tie_up else magnitude > threshold
        out = torch.where(above, torch.tensor(value, dtype=x.dtype, device=x.device), out)
    return torch.where(x < 0, -out, out)


def fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit codes of FP4 values (each already on the grid); the sign bit follows the value's (-0 has it)."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=values.device)
    index = torch.bucketize(values.abs().float(), table)  # exact values: their own index
    return (index | torch.where(torch.signbit(values), 8, 0)).to(torch.uint8)


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit FP4 codes."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2]: FP4 values [N, K] (K even), two codes per byte, the first in the low nibble."""
    codes = fp4_codes(values)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2 * K/2]: the FP4 values of :func:`pack_fp4`'s bytes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([fp4_values(low), fp4_values(high)], dim=-1).reshape(packed.shape[0], -1)


def mx_scale_exponent(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 biased E8M0 exponents of the MX scales for groups with these absolute maxima: the group maximum
    rounded to a power of two the element format's mantissa can reach, less the element format's largest
    exponent, so the group's largest value lands in range (compressed-tensors' ``generate_mx_scales``)."""
    x = absmax.float().clamp(min=torch.finfo(torch.float32).tiny)
    bits_view = x.view(torch.int32)
    # round to the power of two at or above the value once its mantissa would round up in E2M1 (1 mantissa bit)
    rounded = torch.bitwise_and(bits_view + (1 << (23 - 1 - 1)), 0x7F800000).view(torch.float32)
    return (E8M0_BIAS + torch.floor(torch.log2(rounded)) - MX_ELEMENT_EMAX[bits]).to(torch.int32)


def e8m0_value(exponent: torch.Tensor) -> torch.Tensor:
    """float32 powers of two of biased E8M0 exponents."""
    return torch.pow(2.0, exponent.to(torch.int32).float() - E8M0_BIAS)
