"""The engine table: layouts compressed-tensors refuses, vLLM's kernel per layer (integer, float and activation
schemes, the FP8 KV cache), GPTQ and GGUF types; docs/formats.md's preset table is the table rendered."""

from __future__ import annotations

import pytest
import tomllib
from helpers.paths import REPO
from packaging.requirements import Requirement
from packaging.specifiers import Specifier, SpecifierSet

from quantkit.format.engines import (
    COMPRESSED_TENSORS_SINCE,
    TRANSFORMERS_VERSIONS,
    VLLM_VERSION,
    fallback_scheme,
    format_fixes_group,
    gguf_type,
    gptq_support,
    kv_cache_support,
    layout_problem,
    merged_rows_problem,
    transformers_support,
    vllm_kernel,
    widest_dividing_group,
)
from quantkit.format.float_engines import AMPERE, BLACKWELL, HOPPER
from quantkit.format.loads_in import LayerShape, loads_in, vllm_engine
from quantkit.format.preset_table import k_multiple, presets_markdown
from quantkit.format.presets import PRESETS
from quantkit.format.scheme import ActivationScheme, KVCacheScheme, QuantScheme


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
    assert Specifier(f">={COMPRESSED_TENSORS_SINCE}") in set(_pins("dev")["compressed-tensors"])


# --------------------------------------------------------------------------------------------------
# Float and activation-quantized presets
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "k", "problem"),
    [
        ("NVFP4", 168, "group size 16 does not divide its 168 in-features"),  # even, a multiple of 8, not of 16
        ("NVFP4", 160, None),
        ("NVFP4A16", 40, "group size 16"),
        ("MXFP4", 48, "group size 32 does not divide its 48 in-features"),
        ("MXFP8", 96, None),
        ("FP8_BLOCK", 192, "block size 128 does not divide its 192 in-features"),
        ("FP8_BLOCK", 256, None),
        ("FP8_DYNAMIC", 577, None),  # per-channel weights, per-token inputs: any K
        ("FP8", 577, None),
        ("W8A8", 577, None),
        ("W4AFP8", 576, "group size 128"),
    ],
)
def test_float_layout_rules(name, k, problem):
    found = layout_problem(PRESETS[name], k)
    assert (found is None) == (problem is None), found
    if problem:
        assert problem in found


def test_input_groups_and_fp4_pairs_are_rules_of_their_own():
    grouped_inputs = s(bits=8, group=-1, type="float", activations=ActivationScheme("float", 8, "group", True, 128))
    assert layout_problem(grouped_inputs, 192) == "input groups of 128 do not divide its 192 in-features"
    assert layout_problem(grouped_inputs, 384) is None
    # the FP4 pair rule is reached by no preset (16 and 32 are even) but holds for any FP4 layout
    assert k_multiple(PRESETS["NVFP4"]) == 16 and k_multiple(PRESETS["MXFP4A16"]) == 32
    assert k_multiple(PRESETS["FP8_BLOCK"]) == 128 and k_multiple(PRESETS["FP8_DYNAMIC"]) == 1
    assert k_multiple(PRESETS["W4A16"]) == 128 and k_multiple(PRESETS["W8A8"]) == 1


def test_the_format_fixes_float_groups_only():
    assert format_fixes_group(PRESETS["NVFP4"]) and format_fixes_group(PRESETS["MXFP8A16"])
    assert format_fixes_group(PRESETS["FP8_BLOCK"])
    assert not format_fixes_group(PRESETS["FP8_DYNAMIC"]) and not format_fixes_group(PRESETS["FP8"])
    assert not format_fixes_group(PRESETS["W4A16"]) and not format_fixes_group(PRESETS["W4AFP8"])


def test_block_scales_need_whole_blocks_of_merged_rows_in_vllm_only():
    assert "block size 128 does not divide its 192 out-features" in merged_rows_problem(PRESETS["FP8_BLOCK"], 192)
    assert merged_rows_problem(PRESETS["FP8_BLOCK"], 256) is None
    assert merged_rows_problem(PRESETS["FP8_DYNAMIC"], 192) is None
    # k_proj's 64 rows (2 KV heads of 32) ahead of v_proj in vLLM's merged q/k/v; v_proj is last, o_proj unmerged
    block = PRESETS["FP8_BLOCK"]
    layers = [LayerShape(f"model.layers.0.self_attn.{n}_proj", block, 64, 128) for n in ("k", "v", "o")]
    verdicts = {v.engine: v for v in loads_in(layers)}
    hopper = verdicts[vllm_engine(HOPPER)]
    assert not hopper.loads and "out-features" in hopper.layers["model.layers.0.self_attn.k_proj"]
    assert hopper.layers["model.layers.0.self_attn.v_proj"].startswith("DeepGEMM")
    assert hopper.layers["model.layers.0.self_attn.o_proj"].startswith("DeepGEMM")
    assert verdicts["transformers"].loads  # compressed-tensors pads block rows


@pytest.mark.parametrize(
    ("name", "cap", "kernel", "fast"),
    [
        ("FP8_DYNAMIC", HOPPER, "CUTLASS FP8", True),
        ("FP8", AMPERE, "FP8 Marlin (weight-only", False),  # below sm89: W8A16Fp8, activations stay 16-bit
        ("FP8", BLACKWELL, "FlashInfer / CUTLASS FP8", True),
        ("FP8_BLOCK", HOPPER, "DeepGEMM / CUTLASS block FP8", True),
        ("W8A8", AMPERE, "CUTLASS INT8", True),
        ("INT8", BLACKWELL, "CUTLASS INT8", True),
        ("W4AFP8", HOPPER, "CUTLASS W4A8", True),
        ("NVFP4", BLACKWELL, "FlashInfer CUTLASS FP4", True),
        ("NVFP4", HOPPER, "FP4 Marlin (weight-only", False),
        ("NVFP4A16", AMPERE, "FP4 Marlin", True),
        ("MXFP4", BLACKWELL, "FlashInfer MXFP4", True),
        ("MXFP4", AMPERE, "MXFP4 Marlin (weight-only", False),
        ("MXFP4A16", HOPPER, "MXFP4 Marlin", True),
        ("MXFP8", BLACKWELL, "FlashInfer CUTLASS MXFP8", True),
        ("W4A16", BLACKWELL, "Marlin", True),  # integer weight-only keeps the WNA16 table (Machete is Hopper's)
    ],
)
def test_vllm_kernel_of_each_preset(name, cap, kernel, fast):
    support = vllm_kernel(PRESETS[name], 4096, 4096, cap)
    assert support.loads and support.kernel.startswith(kernel) and support.fast == fast


def test_vllm_refuses_w4afp8_off_hopper_and_a_layout_the_format_refuses():
    for cap in (AMPERE, BLACKWELL):
        refused = vllm_kernel(PRESETS["W4AFP8"], 4096, 4096, cap)
        assert not refused.loads and "Hopper only" in refused.reason
    refused = vllm_kernel(PRESETS["NVFP4"], 4096, 168, BLACKWELL)
    assert not refused.loads and "group size 16" in refused.reason
    assert not transformers_support(PRESETS["MXFP4"], 48).loads and transformers_support(PRESETS["MXFP4"], 64).loads


def test_kv_cache_backends():
    tensor, head = KVCacheScheme(strategy="tensor"), KVCacheScheme(strategy="attn_head")
    assert kv_cache_support(tensor, HOPPER).kernel == "FlashAttention 3"
    assert kv_cache_support(tensor, AMPERE).kernel.startswith("FlashInfer")  # FlashAttention 2 keeps no FP8 cache
    assert kv_cache_support(head, HOPPER).loads
    for cap in (AMPERE, BLACKWELL):
        assert "FlashAttention 3" in kv_cache_support(head, cap).reason and not kv_cache_support(head, cap).loads


def test_exports_refuse_float_and_activation_schemes():
    assert "GPTQ v1 holds integer weights" in gptq_support(PRESETS["W8A8"], 576).reason
    assert not gptq_support(PRESETS["FP8_DYNAMIC"], 576).loads
    assert "GGUF blocks hold integer codes" in gguf_type(PRESETS["NVFP4A16"], 576).reason


def test_loads_in_names_the_kv_cache_backend_and_refuses_where_none_keeps_it():
    layers = [LayerShape("q", PRESETS["FP8_DYNAMIC"], 4096, 4096)]
    verdicts = {v.engine: v for v in loads_in(layers, KVCacheScheme(strategy="attn_head"))}
    hopper, ampere = verdicts[vllm_engine(HOPPER)], verdicts[vllm_engine(AMPERE)]
    assert hopper.loads and hopper.summary == "CUTLASS FP8 1; KV cache: FlashAttention 3"
    assert not ampere.loads and "KV cache refused (per-head KV scales" in ampere.summary
    assert verdicts["transformers"].loads and len(verdicts) == 6


def test_the_preset_table_in_the_docs_is_the_engine_table():
    text = (REPO / "docs" / "formats.md").read_text()
    table = text.split("<!-- presets:start -->\n", 1)[1].split("\n<!-- presets:end -->", 1)[0]
    assert table == presets_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows[: len(PRESETS)]] == list(PRESETS)  # every preset, in order
