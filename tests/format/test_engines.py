"""The engine table: layouts compressed-tensors refuses, vLLM's kernel per layer, GPTQ and GGUF types."""

from __future__ import annotations

import pytest
import tomllib
from helpers.paths import REPO
from packaging.requirements import Requirement
from packaging.specifiers import Specifier, SpecifierSet

from quantkit.format.engines import (
    AMPERE,
    DENSE_PACKING_SINCE,
    HOPPER,
    TRANSFORMERS_VERSIONS,
    VLLM_VERSION,
    fallback_scheme,
    gguf_type,
    gptq_support,
    layout_problem,
    transformers_support,
    vllm_kernel,
    widest_dividing_group,
)
from quantkit.format.loads_in import LayerShape, loads_in
from quantkit.format.scheme import QuantScheme


def s(bits: int = 4, group: int = 64, symmetric: bool = True, **kw) -> QuantScheme:
    return QuantScheme(bits=bits, group_size=group, symmetric=symmetric, **kw)


@pytest.mark.parametrize(
    ("scheme", "k", "problem"),
    [
        (s(group=128), 576, "group size 128 does not divide its 576 in-features"),
        (s(group=128), 1536, None),
        (s(group=-1), 577, None),
        (s(act_order=True, static_groups=False), 576, "act-order with dynamic groups"),
        (s(act_order=True, static_groups=True), 576, None),
    ],
)
def test_layout_problem(scheme, k, problem):
    found = layout_problem(scheme, k)
    assert (found is None) == (problem is None)
    if problem:
        assert problem in found


def test_fallback_takes_the_largest_group_that_divides():
    assert fallback_scheme(s(group=128), 576).group_size == 64
    assert fallback_scheme(s(group=128), 160).group_size == 32
    assert fallback_scheme(s(group=64), 100).group_size == -1
    assert fallback_scheme(s(group=128, bits=8), 576).bits == 8
    assert widest_dividing_group([576, 1536]) == 64 and widest_dividing_group([576, 100]) == -1


@pytest.mark.parametrize(
    ("scheme", "n", "k", "cap", "kernel"),
    [
        (s(), 1536, 576, HOPPER, "Machete"),  # SmolLM2 gate/up: K % 64 == 0, N % 128 == 0
        (s(), 576, 576, HOPPER, "Marlin"),  # N % 128 != 0
        (s(), 576, 576, AMPERE, "Marlin"),
        (s(group=32), 1536, 576, HOPPER, "Marlin"),  # Machete takes -1/64/128 only
        (s(symmetric=False), 576, 576, AMPERE, "Marlin"),  # Marlin takes int4 zero points
        (s(bits=8, group=-1, symmetric=False), 1536, 576, HOPPER, "Machete"),
        (s(bits=8, group=-1, symmetric=False), 576, 576, AMPERE, "Conch"),  # no Marlin for int8 zero points
        (s(bits=3, group=64), 576, 576, AMPERE, "Humming"),
    ],
)
def test_vllm_kernel(scheme, n, k, cap, kernel):
    support = vllm_kernel(scheme, n, k, cap)
    assert support.loads and support.kernel.startswith(kernel)
    assert support.fast == (kernel in ("Machete", "Marlin"))


def test_vllm_refuses_what_compressed_tensors_refuses_and_asymmetric_3_bit():
    assert not vllm_kernel(s(group=128), 576, 576, HOPPER).loads
    refused = vllm_kernel(s(bits=3, symmetric=False), 576, 576, HOPPER)
    assert not refused.loads and "asymmetric 3-bit" in refused.reason
    assert not transformers_support(s(group=128), 576).loads
    assert transformers_support(s(bits=3), 576).kernel == "loads (compressed-tensors >=0.18)"


def test_gptq_and_gguf_types():
    assert gptq_support(s(), 576).kernel == "gptq_marlin"
    assert gptq_support(s(bits=2), 576).kernel.startswith("gptq ")
    assert "asymmetric" in gptq_support(s(symmetric=False), 576).reason
    assert "3-bit" in gptq_support(s(bits=3), 576).reason
    assert gguf_type(s(), 576).kernel == "Q4_0" and gguf_type(s(symmetric=False), 576).kernel == "Q4_1"
    assert gguf_type(s(bits=8, group=-1), 576).kernel == "Q8_0" and gguf_type(None, 576).kernel == "F16/BF16"
    assert "whole 32-blocks" in gguf_type(s(group=16), 576).reason
    assert "whole 32-blocks" in gguf_type(s(group=-1), 100).reason
    assert not gguf_type(s(bits=8, symmetric=False), 576).loads and not gguf_type(s(bits=3), 576).loads


def test_loads_in_counts_layers_per_kernel():
    layers = [LayerShape("q", s(), 576, 576), LayerShape("up", s(), 1536, 576), LayerShape("x", s(group=128), 64, 576)]
    verdicts = {v.engine: v for v in loads_in(layers)}
    hopper = verdicts[f"vLLM, Hopper (sm90; predicted from vLLM {VLLM_VERSION} source)"]
    assert not hopper.loads and hopper.layers == {"q": "Marlin", "up": "Machete", "x": hopper.layers["x"]}
    assert hopper.summary.startswith("Marlin 1, Machete 1, refused 1 (group size 128")
    assert verdicts["GGUF (quantkit export)"].summary == "Q4_0 3"
    symmetric = {v.engine: v for v in loads_in(layers[:2])}
    assert symmetric["transformers"].loads and "refuse" not in symmetric["transformers"].summary
    asym = loads_in([LayerShape("q", s(symmetric=False), 576, 576)])[0]
    assert "5.23 and 5.24 refuse asymmetric" in asym.summary
    assert f"transformers {TRANSFORMERS_VERSIONS} with compressed-tensors" in asym.summary


def _pins(extra: str | None = None) -> dict[str, SpecifierSet]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {requirement.name: requirement.specifier for requirement in map(Requirement, listed)}


def test_the_transformers_range_inspect_prints_is_the_pyproject_pin():
    assert _pins()["transformers"] == SpecifierSet(TRANSFORMERS_VERSIONS)
    assert Specifier(f">={DENSE_PACKING_SINCE}") in set(_pins("dev")["compressed-tensors"])
