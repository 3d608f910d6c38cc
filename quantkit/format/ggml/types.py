"""The GGML tensor types quantkit writes: name, gguf enum, block length along a row and bytes per block.

Sizes come from the gguf package's ``GGML_QUANT_SIZES`` (the same table llama.cpp's ``ggml_type_traits`` holds), so
they cannot drift from what the reader expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

from quantkit.errors import QuantkitError

QK_K = 256  # K-quant super-block length


@dataclass(frozen=True, slots=True)
class GGMLType:
    name: str  # "Q4_K"
    qtype: gguf.GGMLQuantizationType
    block: int  # weights per block along a row: 32 or 256
    block_bytes: int  # bytes per block

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / self.block

    @property
    def is_k_quant(self) -> bool:
        return self.block == QK_K


_NAMES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")


def _make(name: str) -> GGMLType:
    qtype = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return GGMLType(name, qtype, block, size)


GGML_TYPES: dict[str, GGMLType] = {n: _make(n) for n in _NAMES}


def ggml_type(name: str) -> GGMLType:
    """The type called ``name`` (case-insensitive)."""
    found = GGML_TYPES.get(name.strip().upper())
    if found is None:
        raise QuantkitError(f"unknown GGML type '{name}': use one of {', '.join(GGML_TYPES)}")
    return found


def fits(t: GGMLType, in_features: int) -> bool:
    """Whether a row of ``in_features`` weights is a whole number of ``t``'s blocks."""
    return in_features > 0 and in_features % t.block == 0


def row_bytes(t: GGMLType, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights stored as ``t``."""
    if not fits(t, in_features):
        raise QuantkitError(
            f"a row of {in_features} weights is not a multiple of {t.name}'s block of {t.block}: "
            "choose a type whose block divides the row (llama.cpp falls back to a 32-block type)"
        )
    return in_features // t.block * t.block_bytes
