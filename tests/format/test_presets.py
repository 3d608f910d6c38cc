"""Every preset means what compressed-tensors 0.20 means by its name (its PRESET_SCHEMES)."""

from __future__ import annotations

import pytest
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

from quantkit.format.presets import PRESETS, preset


def _args(args) -> tuple:
    if args is None:
        return None
    return (
        _plain(args.type),
        args.num_bits,
        _plain(args.strategy),
        args.group_size,
        args.symmetric,
        args.dynamic if isinstance(args.dynamic, bool) else _plain(args.dynamic),
    )


def _plain(value) -> str:
    """compressed-tensors fields are str enums; compare their values with quantkit's plain strings."""
    return str(getattr(value, "value", value))


def _ours(name: str) -> tuple:
    scheme = PRESETS[name]
    group = scheme.group_size if scheme.group_size > 0 and not scheme.block else None
    weights = (scheme.type, scheme.bits, scheme.strategy, group, scheme.symmetric, False)
    a = scheme.activations
    acts = None if a is None else (a.type, a.bits, a.strategy, a.group_size, a.symmetric, a.dynamic)
    return weights, acts


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_is_compressed_tensors(name: str) -> None:
    theirs = PRESET_SCHEMES[name]
    assert _ours(name) == (_args(theirs["weights"]), _args(theirs.get("input_activations")))
    if PRESETS[name].block:
        assert list(theirs["weights"].block_structure) == [PRESETS[name].block] * 2


def test_preset_names_are_case_insensitive_and_unknown_ones_list_the_valid():
    assert preset("fp8_dynamic") == PRESETS["FP8_DYNAMIC"]
    with pytest.raises(Exception, match="unknown scheme preset 'FP9'; use one of W2A16"):
        preset("FP9")
