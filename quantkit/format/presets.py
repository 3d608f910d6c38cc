"""Scheme presets by name, named and defined as compressed-tensors 0.20 defines them
(``compressed_tensors.quantization.quant_scheme.PRESET_SCHEMES``), so an llm-compressor user's
``scheme="FP8_DYNAMIC"`` means the same thing here. One entry per preset; a test compares each with the
package's own definition."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.format.scheme import ActivationScheme, QuantScheme

_INT8_TOKEN = ActivationScheme("int", 8, "token", True)
_FP8_TOKEN = ActivationScheme("float", 8, "token", True)
_FP8_TENSOR_STATIC = ActivationScheme("float", 8, "tensor", False)
_FP8_GROUP128 = ActivationScheme("float", 8, "group", True, group_size=128)
_FP4_NV = ActivationScheme("float", 4, "tensor_group", "local", group_size=16)
_FP4_MX = ActivationScheme("float", 4, "group", True, group_size=32)
_FP8_MX = ActivationScheme("float", 8, "group", True, group_size=32)

# the storage layout of each preset; solver options (act-order, MSE clipping) stay the method's
PRESETS: dict[str, QuantScheme] = {
    "W2A16": QuantScheme(bits=2, group_size=128),
    "W3A16": QuantScheme(bits=3, group_size=128),
    "W4A16": QuantScheme(bits=4, group_size=128),
    "W4A16_ASYM": QuantScheme(bits=4, group_size=128, symmetric=False),
    "W8A16": QuantScheme(bits=8, group_size=128),
    "W8A8": QuantScheme(bits=8, group_size=-1, activations=_INT8_TOKEN),
    "INT8": QuantScheme(bits=8, group_size=-1, activations=_INT8_TOKEN),
    "W4AFP8": QuantScheme(bits=4, group_size=128, activations=_FP8_TOKEN),
    "FP8": QuantScheme(bits=8, group_size=0, type="float", activations=_FP8_TENSOR_STATIC),
    "FP8_DYNAMIC": QuantScheme(bits=8, group_size=-1, type="float", activations=_FP8_TOKEN),
    "FP8_BLOCK": QuantScheme(bits=8, group_size=0, type="float", block=128, activations=_FP8_GROUP128),
    "NVFP4A16": QuantScheme(bits=4, group_size=16, type="float", scale_format="fp8"),
    "NVFP4": QuantScheme(bits=4, group_size=16, type="float", scale_format="fp8", activations=_FP4_NV),
    "MXFP4A16": QuantScheme(bits=4, group_size=32, type="float", scale_format="e8m0"),
    "MXFP4": QuantScheme(bits=4, group_size=32, type="float", scale_format="e8m0", activations=_FP4_MX),
    "MXFP8A16": QuantScheme(bits=8, group_size=32, type="float", scale_format="e8m0"),
    "MXFP8": QuantScheme(bits=8, group_size=32, type="float", scale_format="e8m0", activations=_FP8_MX),
}


def preset(name: str) -> QuantScheme:
    """The layout of a preset; its name is case-insensitive (``fp8_dynamic`` is ``FP8_DYNAMIC``)."""
    found = PRESETS.get(name.upper())
    if found is None:
        raise QuantkitError(f"unknown scheme preset '{name}'; use one of {', '.join(PRESETS)}")
    return found
