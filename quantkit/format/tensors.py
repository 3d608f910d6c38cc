"""The checkpoint tensors of one quantized Linear, written and read back in the compressed-tensors format its scheme
is written in (:mod:`quantkit.format.layouts`, one module per format), named ``<prefix>.<part>``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.errors import QuantkitError
from quantkit.format.layouts import layout_for
from quantkit.format.layouts.base import INPUT_GLOBAL, INPUT_SCALE, SCALE, ZERO, Part
from quantkit.format.layouts.fp4_packed import GLOBAL
from quantkit.format.layouts.packed_int import G_IDX, PACKED, SHAPE, records_g_idx
from quantkit.format.layouts.unpacked import WEIGHT
from quantkit.format.scheme import QuantizedWeight, QuantScheme

# every tensor name a quantized Linear's parts can take (the weight of a dense Linear is also ``weight``)
QUANTIZED_PARTS = (WEIGHT, PACKED, SCALE, ZERO, SHAPE, G_IDX, GLOBAL, INPUT_SCALE, INPUT_GLOBAL)
DENSE_BITS = 16  # an unquantized (fp16/bf16) weight
_SCALE_DTYPES = {16: torch.bfloat16, 32: torch.float32}

__all__ = [
    "GLOBAL",
    "G_IDX",
    "INPUT_GLOBAL",
    "INPUT_SCALE",
    "PACKED",
    "QUANTIZED_PARTS",
    "SCALE",
    "SHAPE",
    "WEIGHT",
    "ZERO",
    "linear_parts",
    "linear_tensors",
    "read_linear",
    "records_g_idx",
    "storage_bits",
]


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def linear_parts(scheme: QuantScheme, n: int, k: int, scale_dtype: torch.dtype) -> list[Part]:
    """The stored tensors (name, shape, dtype) of an [n, k] Linear under ``scheme``."""
    return layout_for(scheme).parts(scheme, n, k, scale_dtype)


def linear_tensors(prefix: str, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one quantized Linear (names prefixed with ``prefix.``)."""
    try:
        tensors = layout_for(qw.scheme).write(qw, scale_dtype)
    except QuantkitError as exc:
        raise QuantkitError(f"{prefix}: {exc}") from exc
    return {_key(prefix, name): tensor for name, tensor in tensors.items()}


def read_linear(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> QuantizedWeight:
    """Inverse of :func:`linear_tensors`: the quantized weight of one Linear (scales as float32)."""
    start = f"{prefix}." if prefix else ""
    own = {
        key[len(start) :]: t
        for key, t in tensors.items()
        if key.startswith(start) and key[len(start) :] in QUANTIZED_PARTS
    }
    return layout_for(scheme).read(own, scheme, prefix)


def storage_bits(scheme: QuantScheme | None, n_out: int, k_in: int, scale_bits: int = 16) -> int:
    """Exact bits of one Linear's stored tensors ([n_out, k_in] weight), as inspect_checkpoint counts them: every
    part of its layout but ``weight_shape``, with ``scale_bits``-bit scales where the scales take the model's dtype.
    ``None`` (fp16): 16 bits a weight."""
    if n_out <= 0 or k_in <= 0:
        raise QuantkitError(f"a Linear weight must have positive dimensions, got [{n_out}, {k_in}]")
    if scheme is None:
        return DENSE_BITS * n_out * k_in
    parts = linear_parts(scheme, n_out, k_in, _SCALE_DTYPES[scale_bits])
    return sum(part.bits for part in parts if part.counted)
