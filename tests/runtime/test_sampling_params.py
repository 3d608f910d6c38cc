"""SamplingParams validation: every bad field raises QuantkitError naming the field, the value and the range."""

from __future__ import annotations

import pytest

from quantkit.errors import QuantkitError
from quantkit.runtime.sampling_params import SamplingParams


def test_defaults_are_valid_and_not_greedy() -> None:
    p = SamplingParams()
    p.validate()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1.0, 1.0, -1, None, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert not p.greedy


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [({"temperature": 0.0}, True), ({"temperature": 0}, True), ({"top_k": 1}, True), ({"temperature": 0.7}, False)],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"temperature": -0.5}, ["temperature", "-0.5", ">= 0"]),
        ({"temperature": float("nan")}, ["temperature", "nan", ">= 0"]),
        ({"temperature": float("inf")}, ["temperature", "inf", "finite"]),
        ({"temperature": "hot"}, ["temperature", "'hot'", ">= 0"]),
        ({"top_p": 0.0}, ["top_p", "0.0", "0 < top_p <= 1"]),
        ({"top_p": 1.5}, ["top_p", "1.5", "0 < top_p <= 1"]),
        ({"top_k": 0}, ["top_k", "=0", "-1 (disabled)", ">= 1"]),
        ({"top_k": -2}, ["top_k", "-2", "-1 (disabled)"]),
        ({"top_k": 2.5}, ["top_k", "2.5", "integer"]),
        ({"seed": -1}, ["seed", "-1", "[0, 2**64)"]),
        ({"seed": 1.0}, ["seed", "1.0", "integer"]),
        ({"max_tokens": 0}, ["max_tokens", "=0", ">= 1"]),
        ({"max_tokens": True}, ["max_tokens", "True", ">= 1"]),
        ({"stop": [""]}, ["stop", "['']", "non-empty strings"]),
        ({"stop_token_ids": [3, -1]}, ["stop_token_ids", "[3, -1]", ">= 0"]),
        ({"ignore_eos": 1}, ["ignore_eos", "1", "True or False"]),
    ],
)
def test_invalid_values_name_field_value_and_range(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(QuantkitError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_validate_catches_mutation_after_construction() -> None:
    p = SamplingParams(temperature=0.5)
    p.top_p = 0.0
    with pytest.raises(QuantkitError, match=r"top_p=0\.0"):
        p.validate()


def test_boundaries_accepted_and_lists_copied() -> None:
    stops = ["</s>"]
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, seed=0, max_tokens=1, stop=stops, stop_token_ids=[0])
    stops.append("x")
    assert p.stop == ["</s>"]
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop_token_ids=7).stop_token_ids == [7]
    SamplingParams(top_p=1e-6, seed=2**64 - 1)  # tiny nucleus and the largest seed are valid
