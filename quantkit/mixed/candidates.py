"""Mixed-precision candidates: short names <-> schemes, and the exact storage cost of one Linear.

Candidate syntax: ``int<bits>[-g<group>][-asym]``, a float format (``nvfp4``, ``mxfp4``, ``mxfp8``, ``fp8``) or
``fp16`` (left unquantized). Integers take bits in {2, 3, 4, 8} and group in {32, 64, 128}; no ``-g`` means
per-channel (one scale per output row). Examples: ``int4-g128``, ``int8`` (per-channel, symmetric),
``int4-g64-asym``. The float formats are weight-only (16-bit activations) and their layout is a compressed-tensors
preset's weight scheme (:data:`FLOAT_CANDIDATES`), so its numbers live in :mod:`quantkit.format.presets` alone:
``nvfp4`` (FP4 in groups of 16 under FP8 scales and a float32 global scale: NVFP4A16), ``mxfp4`` / ``mxfp8`` (FP4 /
FP8 in groups of 32 under E8M0 scales: MXFP4A16, MXFP8A16) and ``fp8`` (FP8 per channel, FP8_DYNAMIC's weights
with 16-bit activations). Candidates describe storage only: act-order with static groups and MSE clipping are
solver options that do not change the stored tensors.

Storage cost (:func:`storage_bits`) counts exactly what :mod:`quantkit.format.inspect` counts for the candidate's
layout (``weight_shape`` excluded): packed words or codes, scales, packed zero points, g_idx and NVFP4's global
scale, which every linear stores (the linears of a fused projection store the same value, one copy each).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable

from quantkit.errors import QuantkitError
from quantkit.format.presets import PRESETS
from quantkit.format.scheme import SUPPORTED_BITS, QuantScheme
from quantkit.format.tensors import storage_bits

FP16 = "fp16"
GROUP_SIZES = (32, 64, 128)
# float candidate -> the preset whose weight scheme it stores; activations stay 16-bit (weight-only), because a
# plan mixes them with integer weight-only schemes that vLLM and transformers run with 16-bit inputs
FLOAT_CANDIDATES = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16", "mxfp8": "MXFP8A16", "fp8": "FP8_DYNAMIC"}
DEFAULT_CANDIDATES = ("int4-g128", "int4-g64", "int4-g32", "int8", FP16)  # what sensitivity measures
STANDARD_CANDIDATES = ("int4-g128", "int4-g64", "int4-g32", "int8", "int8-g128", "int3-g64", "int4-g64-asym", FP16)
SYNTAX = (
    "int<bits>[-g<group>][-asym] (bits 2, 3, 4, 8; group 32, 64, 128; no -g: per-channel), "
    f"a float format ({', '.join(FLOAT_CANDIDATES)}) or fp16"
)

_NAME = re.compile(r"int(\d+)(?:-g(\d+))?(-asym)?")


def float_scheme(name: str) -> QuantScheme:
    """The weight-only scheme of a float candidate: its preset's weights, activations dropped."""
    return dataclasses.replace(PRESETS[FLOAT_CANDIDATES[name]], activations=None)


def all_candidate_names() -> list[str]:
    """Every valid candidate name (used for "did you mean" suggestions)."""
    names = [FP16, *FLOAT_CANDIDATES]
    for bits in SUPPORTED_BITS:
        for group in ("", *(f"-g{g}" for g in GROUP_SIZES)):
            names += [f"int{bits}{group}", f"int{bits}{group}-asym"]
    return names


def did_you_mean(name: str) -> str:
    """``"did you mean 'x'? "`` for the closest valid candidate name, or "" when none is close."""
    close = difflib.get_close_matches(str(name).strip().lower(), all_candidate_names(), n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}? " if close else ""


def parse_candidate(name: str) -> QuantScheme | None:
    """The scheme a candidate name stands for; None for ``fp16`` (unquantized)."""
    text = name.strip().lower() if isinstance(name, str) else ""
    if text == FP16:
        return None
    if text in FLOAT_CANDIDATES:
        return float_scheme(text)
    match = _NAME.fullmatch(text)
    bits = int(match.group(1)) if match else 0
    group = int(match.group(2)) if match and match.group(2) else -1
    if not match or bits not in SUPPORTED_BITS or (group != -1 and group not in GROUP_SIZES):
        hint = did_you_mean(name).strip()  # last, so the message still opens with the syntax
        raise QuantkitError(
            f"unknown candidate {name!r}; use {SYNTAX}, e.g. {', '.join(STANDARD_CANDIDATES)}"
            + (f"; {hint}" if hint else "")
        )
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
    if scheme.is_float or scheme.activations is not None:
        found = next((name for name in FLOAT_CANDIDATES if float_scheme(name) == scheme), None)
        if found is None:
            raise QuantkitError(
                f"scheme {scheme.name} is not a candidate; the float candidates are weight-only "
                f"{', '.join(f'{n} ({p})' for n, p in FLOAT_CANDIDATES.items())}"
            )
        return found
    group = "" if scheme.per_channel else f"-g{scheme.group_size}"
    return f"int{scheme.bits}{group}{'' if scheme.symmetric else '-asym'}"


def unit_storage_bits(scheme: QuantScheme | None, shapes: Iterable[tuple[int, int]], scale_bits: int = 16) -> int:
    """Total storage of several Linears sharing one scheme (a fused group), ``shapes`` as (out, in)."""
    return sum(storage_bits(scheme, n, k, scale_bits) for n, k in shapes)
