"""Scheme presets by name, named and defined as compressed-tensors 0.20 defines them
(``compressed_tensors.quantization.quant_scheme.PRESET_SCHEMES``), so an llm-compressor user's ``scheme="W4A16"``
means the same thing here. One entry per preset quantkit writes; a test compares each with the package's."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme

# weight-only integer presets: a storage layout (bits, group, symmetry); solver options stay the method's
PRESETS: dict[str, QuantScheme] = {
    "W2A16": QuantScheme(bits=2, group_size=128, symmetric=True),
    "W3A16": QuantScheme(bits=3, group_size=128, symmetric=True),
    "W4A16": QuantScheme(bits=4, group_size=128, symmetric=True),
    "W4A16_ASYM": QuantScheme(bits=4, group_size=128, symmetric=False),
    "W8A16": QuantScheme(bits=8, group_size=128, symmetric=True),
}


def preset(name: str) -> QuantScheme:
    """The storage layout of a preset; its name is case-insensitive (``w4a16`` is ``W4A16``)."""
    found = PRESETS.get(name.upper())
    if found is None:
        raise QuantkitError(f"unknown scheme preset '{name}'; use one of {', '.join(PRESETS)}")
    return found
