"""The checkpoint layouts of a quantized Linear, one module per compressed-tensors format, and which format a
scheme is written in: the first of compressed-tensors' own priority order whose compressor takes the scheme
(``compressed_tensors.compressors.format.COMPRESSION_FORMAT_PRIORITY``: MXFP4, MXFP8, NVFP4, int-quantized,
pack-quantized, float-quantized, naive-quantized), so quantkit and llm-compressor write a preset the same way; an
unpacked scheme is naive-quantized, the format a config group may ask compressed-tensors for."""

from __future__ import annotations

from quantkit.format.layouts.base import Layout
from quantkit.format.layouts.fp4_packed import PackedFP4
from quantkit.format.layouts.packed_int import PackedInt
from quantkit.format.layouts.unpacked import Unpacked
from quantkit.format.scheme import QuantScheme

PACK_QUANTIZED = PackedInt()
INT_QUANTIZED = Unpacked("int-quantized")
FLOAT_QUANTIZED = Unpacked("float-quantized")
NAIVE_QUANTIZED = Unpacked("naive-quantized")
MXFP8_QUANTIZED = Unpacked("mxfp8-quantized")
NVFP4_PACKED = PackedFP4("nvfp4-pack-quantized")
MXFP4_PACKED = PackedFP4("mxfp4-pack-quantized")
LAYOUTS = {
    layout.format: layout
    for layout in (
        PACK_QUANTIZED,
        INT_QUANTIZED,
        FLOAT_QUANTIZED,
        NAIVE_QUANTIZED,
        MXFP8_QUANTIZED,
        NVFP4_PACKED,
        MXFP4_PACKED,
    )
}
MIXED_PRECISION = "mixed-precision"  # the top-level format of a checkpoint whose groups use several


def layout_for(scheme: QuantScheme) -> Layout:
    """The format compressed-tensors writes the scheme in."""
    if scheme.is_float and scheme.bits == 4:
        return MXFP4_PACKED if scheme.scale_format == "e8m0" else NVFP4_PACKED
    if scheme.is_float and scheme.scale_format == "e8m0":
        return MXFP8_QUANTIZED
    if scheme.unpacked:  # compressed-tensors writes it so when a group's format asks for it
        return NAIVE_QUANTIZED
    if not scheme.is_float:
        return PACK_QUANTIZED if scheme.activations is None else INT_QUANTIZED
    return NAIVE_QUANTIZED if scheme.activations is None else FLOAT_QUANTIZED
