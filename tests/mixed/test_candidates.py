"""Candidate names <-> schemes, and storage costs that agree exactly with `quantkit inspect`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny import rtn_for_tests

from quantkit.errors import QuantkitError
from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter
from quantkit.mixed.candidates import (
    STANDARD_CANDIDATES,
    all_candidate_names,
    candidate_name,
    parse_candidate,
    storage_bits,
    unit_storage_bits,
)


def test_standard_names_parse_and_round_trip() -> None:
    assert parse_candidate("fp16") is None
    assert parse_candidate("int8") == QuantScheme(bits=8, group_size=-1, symmetric=True)
    assert parse_candidate("int4-g64-asym") == QuantScheme(bits=4, group_size=64, symmetric=False)
    assert parse_candidate("int3-g64") == QuantScheme(bits=3, group_size=64)
    for name in [*STANDARD_CANDIDATES, *all_candidate_names()]:
        assert candidate_name(parse_candidate(name)) == name
    assert len(set(all_candidate_names())) == len(all_candidate_names()) == 37  # 32 integer, 4 float, fp16


@pytest.mark.parametrize("bad", ["int5", "int4-g46", "int4-g128-sym", "q4", "", "int4-g0"])
def test_unknown_names_explain_the_syntax(bad: str) -> None:
    with pytest.raises(QuantkitError, match=r"unknown candidate .*int<bits>\[-g<group>\]\[-asym\]"):
        parse_candidate(bad)


def test_solver_options_are_not_candidates() -> None:
    with pytest.raises(QuantkitError, match="act-order"):
        candidate_name(QuantScheme(bits=4, group_size=128, act_order=True))


def test_dense_and_fused_costs() -> None:
    assert storage_bits(None, 576, 1536) == 16 * 576 * 1536
    shapes = [(576, 576), (192, 576), (192, 576)]
    scheme = parse_candidate("int4-g128")
    assert unit_storage_bits(scheme, shapes) == sum(storage_bits(scheme, n, k) for n, k in shapes)
    # hand count: 960 rows x 72 words x 32 + 960 x 5 groups x 16 bf16 scale bits
    assert unit_storage_bits(scheme, shapes) == 960 * 72 * 32 + 960 * 5 * 16
    with pytest.raises(QuantkitError, match="positive"):
        storage_bits(scheme, 0, 8)


def _inspected_bits_per_weight(path: Path, scheme: QuantScheme, n: int, k: int) -> float:
    qw = rtn_for_tests(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)), scheme)
    with ShardedWriter(path) as writer:
        writer.add(linear_tensors("layer.proj", qw, torch.bfloat16))
        writer.finalize({}, [], quantization_config=build_quantization_config([(scheme, ["Linear"])], []))
    (layer,) = inspect_checkpoint(path).layers
    assert (layer.out_features, layer.in_features) == (n, k)
    return layer.bits_per_weight


CASES = [
    ("int4-g128", 64, 576, {}),
    ("int3-g64", 48, 160, {}),  # ragged last group, 3-bit words straddle
    ("int8", 24, 96, {}),
    ("int8-g128", 24, 96, {}),  # one (short) group
    ("int4-g64-asym", 40, 200, {}),  # zero points: ceil(40*4/32) = 5 words per group
    ("int2-g32-asym", 33, 100, {}),  # padded zero-point words
    ("int3", 8, 100, {}),  # 300 bits per row -> 10 words
    ("int4-g32", 16, 96, {"act_order": True}),  # g_idx stored
    ("int4-g32", 16, 96, {"act_order": True, "static_groups": True}),  # no g_idx
]


@pytest.mark.parametrize(("name", "n", "k", "extra"), CASES)
def test_storage_bits_match_inspect_checkpoint(tmp_path: Path, name: str, n: int, k: int, extra: dict) -> None:
    base = parse_candidate(name)
    scheme = QuantScheme(bits=base.bits, group_size=base.group_size, symmetric=base.symmetric, **extra)
    bpw = _inspected_bits_per_weight(tmp_path / "ckpt", scheme, n, k)
    bits = storage_bits(scheme, n, k)
    assert round(bpw * n * k) == bits
    assert bpw == pytest.approx(bits / (n * k), rel=1e-12)
