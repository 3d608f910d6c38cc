"""vLLM's fused-MoE rules for routed experts (quantkit/format/moe_engines.py): which MoE method and kernel load a
scheme's experts per GPU generation, the Marlin MoE kernel's bit widths, group sizes, zero points and tiles, the
FP8, INT8 and W4AFP8 methods' layouts, and the docs' MoE table rendered from them."""

from __future__ import annotations

import pytest
from helpers.paths import REPO

from quantkit.format.float_engines import AMPERE, BLACKWELL, CAPABILITIES, HOPPER
from quantkit.format.moe_engines import (
    MARLIN_MOE_GROUPS,
    moe_layout_problem,
    moe_method,
    moe_refusal,
    vllm_moe_kernel,
)
from quantkit.format.preset_table import MOE_EXTRA_ROWS, moe_markdown, moe_multiple
from quantkit.format.presets import PRESETS
from quantkit.format.scheme import ActivationScheme, QuantScheme

HIDDEN, WIDTH = 4096, 1536  # Qwen3-235B-A22B's experts: every rule's multiple divides them


def s(bits: int = 4, group: int = 128, symmetric: bool = True, **kw) -> QuantScheme:
    return QuantScheme(bits=bits, group_size=group, symmetric=symmetric, **kw)


def kernels(scheme: QuantScheme, hidden: int | None = HIDDEN, inter: int | None = WIDTH) -> list[str | None]:
    return [vllm_moe_kernel(scheme, c, hidden, inter).kernel for c in CAPABILITIES]


# --------------------------------------------------------------------------------------------------
# Integer weight-only experts: the Marlin MoE kernel
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", MARLIN_MOE_GROUPS)
@pytest.mark.parametrize("bits", [4, 8])
def test_marlin_moe_takes_int4_and_int8_in_its_group_sizes(bits: int, group: int) -> None:
    assert kernels(s(bits, group)) == ["Marlin MoE"] * 3
    assert all(vllm_moe_kernel(s(bits, group), c, HIDDEN, WIDTH).fast for c in CAPABILITIES)
    assert moe_method(s(bits, group)) == "WNA16Marlin" and moe_layout_problem(s(bits, group), HIDDEN, WIDTH) is None


@pytest.mark.parametrize("group", [16, 256])
def test_other_group_sizes_are_refused(group: int) -> None:
    problem = moe_layout_problem(s(4, group))
    assert problem is not None and f"group size {group}" in problem and "use group size 128, 64 or 32" in problem


@pytest.mark.parametrize("bits", [2, 3])
def test_widths_other_than_4_and_8_only_reach_the_optional_humming_backend(bits: int) -> None:
    refusal = moe_refusal(s(bits))
    assert refusal is not None and f"{bits}-bit experts" in refusal.reason and "humming-kernels" in refusal.reason
    assert moe_method(s(bits)) == "Humming" and kernels(s(bits)) == [None] * 3


def test_zero_points_for_int4_only() -> None:
    asym4 = vllm_moe_kernel(s(4, symmetric=False), HOPPER, HIDDEN, WIDTH)
    assert asym4.loads and asym4.fast and "zero points" in asym4.kernel and "vllm#44025" in asym4.kernel
    problem = moe_layout_problem(s(8, symmetric=False))
    assert problem is not None and "asymmetric int8 experts" in problem and "W4A16_ASYM" in problem


@pytest.mark.parametrize(
    ("hidden", "ok"),
    [(2048, True), (2112, False), (4160, False), (128, True)],  # 2112 = 64 * 33, 4160 = 64 * 65
)
def test_the_hidden_size_must_be_whole_marlin_tiles_of_128(hidden: int, ok: bool) -> None:
    problem = moe_layout_problem(s(4, 64), hidden_size=hidden, intermediate_size=WIDTH)
    assert (problem is None) == ok
    if not ok:
        assert f"hidden size {hidden} is not a multiple of 128" in problem and "--ignore" in problem


def test_the_group_must_divide_hidden_size_and_expert_width() -> None:
    assert "does not divide the expert width 1472" in moe_layout_problem(s(4, 128), HIDDEN, 1472)  # 1472 = 64 * 23
    assert moe_layout_problem(s(4, 64), HIDDEN, 1472) is None
    assert moe_layout_problem(s(4, -1), HIDDEN, 100) is None  # per-channel: no group to divide


@pytest.mark.parametrize(
    ("group", "inter", "ok"),
    [(32, 1472, True), (32, 1440, False), (128, 1408, True)],  # 1440 = 32 * 45: whole groups, not whole tiles
)
def test_dynamic_act_order_needs_the_expert_width_in_whole_tiles(group: int, inter: int, ok: bool) -> None:
    problem = moe_layout_problem(s(4, group, act_order=True), HIDDEN, inter)
    assert (problem is None) == ok
    if not ok:
        assert f"multiple of {max(64, group)}" in problem and "static act-order" in problem
    # static groups are stored in column order (actorder "weight"): vLLM pads the width to its tile
    assert moe_layout_problem(s(4, group, act_order=True, static_groups=True), HIDDEN, inter) is None
    assert moe_layout_problem(s(4, -1, act_order=True), HIDDEN, 1440) is None  # channel-wise: vLLM sees no act-order


def test_shape_rules_apply_only_when_the_shape_is_given() -> None:
    assert moe_layout_problem(s(4, 128)) is None
    assert moe_layout_problem(s(4, 128), hidden_size=HIDDEN) is None
    assert moe_layout_problem(s(4, 128), intermediate_size=1472) is not None


# --------------------------------------------------------------------------------------------------
# Activation-quantized and float experts
# --------------------------------------------------------------------------------------------------


def test_w4afp8_experts_load_on_hopper_only_in_cutlass_shapes() -> None:
    w4afp8 = PRESETS["W4AFP8"]
    assert kernels(w4afp8) == [None, "CUTLASS W4A8 MoE", None]
    for cap in (AMPERE, BLACKWELL):
        assert "Hopper only" in vllm_moe_kernel(w4afp8, cap, HIDDEN, WIDTH).reason
    assert moe_layout_problem(w4afp8, HIDDEN, WIDTH) is None  # Hopper loads it
    assert "multiple of 256" in moe_layout_problem(w4afp8, HIDDEN, 1408)  # 1408 = 128 * 11
    assert "multiple of 256" in moe_layout_problem(w4afp8, 2176, WIDTH)  # 2176 = 128 * 17
    acts = w4afp8.activations
    assert "groups a multiple of 128" in moe_layout_problem(s(4, 64, activations=acts))
    assert "symmetric" in moe_layout_problem(s(4, 128, symmetric=False, activations=acts))


def test_int8_experts_need_per_channel_weights_and_dynamic_token_inputs() -> None:
    assert kernels(PRESETS["W8A8"]) == ["Triton INT8 MoE"] * 3 and moe_method(PRESETS["W8A8"]) == "W8A8Int8"
    static = ActivationScheme("int", 8, "tensor", False)
    assert "dynamic per-token inputs" in moe_layout_problem(s(8, -1, activations=static))
    token = PRESETS["W8A8"].activations
    assert moe_layout_problem(s(8, -1, symmetric=False, activations=token)) is not None
    assert moe_layout_problem(s(8, 128, activations=token)) is not None  # grouped weights
    assert "CPU-only" in moe_layout_problem(s(4, 128, activations=token))


@pytest.mark.parametrize(
    ("name", "cap", "kernel", "fast"),
    [
        ("FP8", AMPERE, "FP8 Marlin MoE (weight-only", False),
        ("FP8", HOPPER, "CUTLASS FP8 MoE", True),
        ("FP8_DYNAMIC", BLACKWELL, "FlashInfer FP8 MoE", True),
        ("FP8_BLOCK", HOPPER, "Triton block FP8 MoE", True),
        ("NVFP4", HOPPER, "FP4 Marlin MoE (weight-only", False),
        ("NVFP4", BLACKWELL, "FlashInfer / CUTLASS FP4 MoE", True),
        ("NVFP4A16", AMPERE, "FP4 Marlin MoE", True),
        ("MXFP4", BLACKWELL, "FlashInfer MXFP4 MoE (weight-only", False),  # the oracle's default keeps 16-bit inputs
        ("MXFP4A16", HOPPER, "MXFP4 Marlin MoE", True),
        ("MXFP8", BLACKWELL, "FlashInfer MXFP8 MoE", True),
        ("MXFP8A16", BLACKWELL, "FlashInfer MXFP8 MoE (quantizes the 16-bit inputs", True),
    ],
)
def test_float_experts_kernel_per_gpu(name: str, cap: int, kernel: str, fast: bool) -> None:
    support = vllm_moe_kernel(PRESETS[name], cap, HIDDEN, WIDTH)
    assert support.loads and support.kernel.startswith(kernel) and support.fast == fast


def test_fp8_expert_layouts() -> None:
    channel_static = s(8, -1, type="float", activations=ActivationScheme("float", 8, "tensor", False))
    assert "per-channel weights with dynamic per-token inputs" in moe_layout_problem(channel_static)
    assert "16-bit inputs" in moe_layout_problem(s(8, -1, type="float"))  # FP8 weight-only: no MoE method
    assert moe_method(s(8, -1, type="float")) == "none"
    block = PRESETS["FP8_BLOCK"]
    assert "block size 128 does not divide the expert width 1472" in moe_layout_problem(block, HIDDEN, 1472)
    assert moe_layout_problem(block, HIDDEN, 1408) is None
    assert moe_layout_problem(PRESETS["FP8_DYNAMIC"], HIDDEN, 1472) is None


def test_moe_methods_of_the_float_presets() -> None:
    methods = {name: moe_method(PRESETS[name]) for name in ("FP8", "NVFP4A16", "NVFP4", "MXFP4", "MXFP8A16")}
    assert methods == {
        "FP8": "W8A8Fp8",
        "NVFP4A16": "W4A4Nvfp4",
        "NVFP4": "W4A4Nvfp4",
        "MXFP4": "W4A4Mxfp4",
        "MXFP8A16": "W8A8Mxfp8",
    }


def test_every_preset_loads_as_experts_except_the_2_and_3_bit_ones() -> None:
    refused = {name for name, scheme in PRESETS.items() if moe_layout_problem(scheme, HIDDEN, WIDTH)}
    assert refused == {"W2A16", "W3A16"}


def test_a_problem_is_one_line_naming_the_scheme_and_the_fix() -> None:
    problem = moe_layout_problem(s(4, 256), HIDDEN, WIDTH)
    assert problem.startswith("vLLM's fused-MoE layer cannot load w4-g256-sym experts: ") and "\n" not in problem
    assert problem.count(";") >= 1


# --------------------------------------------------------------------------------------------------
# The docs' table
# --------------------------------------------------------------------------------------------------


def test_the_shape_columns_are_the_rules_multiples() -> None:
    assert moe_multiple(PRESETS["W4A16"], "hidden") == 128 and moe_multiple(PRESETS["W4A16"], "intermediate") == 128
    assert moe_multiple(PRESETS["W4AFP8"], "hidden") == 256 and moe_multiple(PRESETS["W4AFP8"], "intermediate") == 256
    assert moe_multiple(PRESETS["FP8_BLOCK"], "intermediate") == 128 and moe_multiple(PRESETS["FP8"], "hidden") == 1
    assert moe_multiple(s(4, 32, act_order=True), "intermediate") == 64
    assert moe_multiple(PRESETS["W2A16"], "hidden") is None


def test_the_moe_table_in_the_docs_is_the_rules_rendered() -> None:
    text = (REPO / "docs" / "formats.md").read_text()
    table = text.split("<!-- moe-experts:start -->\n", 1)[1].split("\n<!-- moe-experts:end -->", 1)[0]
    assert table == moe_markdown()
    rows = table.splitlines()[2:]
    assert len(rows) == len(PRESETS) + len(MOE_EXTRA_ROWS)
    assert [row.split("`")[1] for row in rows[: len(PRESETS)]] == list(PRESETS)


def test_inspect_judges_routed_experts_by_the_fused_moe_rules() -> None:
    from quantkit.format.loads_in import LayerShape, loads_in

    scheme = QuantScheme(bits=4, group_size=128, symmetric=True)
    layers = [
        LayerShape("model.layers.0.mlp.experts.0.gate_proj", scheme, 768, 2048),
        LayerShape("model.layers.0.mlp.experts.0.down_proj", scheme, 2048, 768),
        LayerShape("model.layers.0.block_sparse_moe.experts.1.w2", scheme, 2048, 768),
        LayerShape("model.layers.0.self_attn.q_proj", scheme, 2048, 2048),
    ]
    hopper = next(v for v in loads_in(layers) if "sm90" in v.engine)
    assert hopper.loads
    experts = [hopper.layers[s.name] for s in layers[:3]]
    assert len(set(experts)) == 1 and experts[0] != hopper.layers[layers[3].name]  # the MoE kernel, not the dense
    narrow = [LayerShape("model.layers.0.mlp.experts.0.up_proj", scheme, 768, 64)]  # hidden 64: no Marlin MoE tile
    assert not next(v for v in loads_in(narrow) if "sm90" in v.engine).loads
