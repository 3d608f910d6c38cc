"""Mixed-precision candidates: short names <-> schemes, and the exact storage cost of one Linear.

Candidate syntax: ``int<bits>[-g<group>][-asym]`` or ``fp16`` (left unquantized), with bits in {2, 3, 4, 8}
and group in {32, 64, 128}; no ``-g`` means per-channel (one scale per output row). Examples: ``int4-g128``,
``int8`` (per-channel, symmetric), ``int4-g64-asym``. Candidates describe storage only: act-order with static
groups and MSE clipping are solver options that do not change the stored tensors.

Storage cost (:func:`storage_bits`) counts exactly what :mod:`quantkit.format.inspect` counts for a
``pack-quantized`` Linear (``weight_shape`` excluded): packed words, scales, packed zero points, g_idx.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from quantkit.errors import QuantkitError
from quantkit.format.scheme import SUPPORTED_BITS, QuantScheme
from quantkit.format.tensors import storage_bits

FP16 = "fp16"
GROUP_SIZES = (32, 64, 128)
DEFAULT_CANDIDATES = ("int4-g128", "int4-g64", "int4-g32", "int8", FP16)  # what sensitivity measures
STANDARD_CANDIDATES = ("int4-g128", "int4-g64", "int4-g32", "int8", "int8-g128", "int3-g64", "int4-g64-asym", FP16)
SYNTAX = "int<bits>[-g<group>][-asym] (bits 2, 3, 4, 8; group 32, 64, 128; no -g: per-channel) or fp16"

_NAME = re.compile(r"int(\d+)(?:-g(\d+))?(-asym)?")


def all_candidate_names() -> list[str]:
    """Every valid candidate name (used for "did you mean" suggestions)."""
    names = [FP16]
    for bits in SUPPORTED_BITS:
        for group in ("", *(f"-g{g}" for g in GROUP_SIZES)):
            names += [f"int{bits}{group}", f"int{bits}{group}-asym"]
    return names


def parse_candidate(name: str) -> QuantScheme | None:
    """The scheme a candidate name stands for; None for ``fp16`` (unquantized)."""
    text = name.strip().lower() if isinstance(name, str) else ""
    if text == FP16:
        return None
    match = _NAME.fullmatch(text)
    bits = int(match.group(1)) if match else 0
    group = int(match.group(2)) if match and match.group(2) else -1
    if not match or bits not in SUPPORTED_BITS or (group != -1 and group not in GROUP_SIZES):
        raise QuantkitError(f"unknown candidate {name!r}; use {SYNTAX}, e.g. {', '.join(STANDARD_CANDIDATES)}")
    return QuantScheme(bits=bits, group_size=group, symmetric=match.group(3) is None)


def candidate_name(scheme: QuantScheme | None) -> str:
    """Inverse of :func:`parse_candidate` (act-order and MSE clipping are not part of a candidate)."""
    if scheme is None:
        return FP16
    if scheme.act_order or scheme.mse_clip:
        raise QuantkitError(
            f"scheme {scheme.name} has solver options (act-order / mse clip) that candidates do not name; "
            "plan with the plain storage scheme and apply solver options when quantizing"
        )
    group = "" if scheme.per_channel else f"-g{scheme.group_size}"
    return f"int{scheme.bits}{group}{'' if scheme.symmetric else '-asym'}"


def unit_storage_bits(scheme: QuantScheme | None, shapes: Iterable[tuple[int, int]], scale_bits: int = 16) -> int:
    """Total storage of several Linears sharing one scheme (a fused group), ``shapes`` as (out, in)."""
    return sum(storage_bits(scheme, n, k, scale_bits) for n, k in shapes)
