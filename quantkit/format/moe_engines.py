"""What vLLM's fused-MoE layer accepts for a checkpoint's routed experts: the engine table's MoE rules.

vLLM never loads routed experts as Linear layers. Its model code builds one fused-MoE layer per decoder layer holding
every expert's gate and up (``w13``) and down (``w2``) projections as 3-D tensors, and
``CompressedTensorsMoEMethod.get_moe_method`` picks one quantization method for all of them from the config group of
expert 0's projections (``<moe>.experts.0.gate_proj / up_proj / down_proj``, all three must share a scheme; a group
targeting ``Linear`` is aliased to the fused layer by ``_add_fused_moe_to_target_scheme_map``). The dense kernel
rules (:func:`quantkit.format.engines.vllm_kernel`) therefore do not apply to experts; these do, on top of
compressed-tensors' layout rules (:func:`~quantkit.format.engines.layout_problem`), which every expert linear must
pass as well. An expert's gate and up read the hidden size H and write the expert width I (``moe_intermediate_size``,
Mixtral's ``intermediate_size``); its down reads I and writes H.

- Integer weight-only experts go to ``CompressedTensorsWNA16MarlinMoEMethod``, the fused Marlin MoE kernel on every
  CUDA GPU from sm75: int4 and int8 only (other widths only reach the optional Humming MoE backend); group sizes -1,
  32, 64 and 128 and H a multiple of 128 (``check_moe_marlin_supports_layer``); the group must divide H and I
  (``create_weights`` raises otherwise); dynamic act-order groups (a g_idx per expert) need I a multiple of
  ``max(64, group)`` too, otherwise "WNA16MoE is not supported with actorder=group/dynamic". Zero points: int4 only
  (``MarlinExperts._supports_quant_scheme`` lists the asymmetric int4 keys, no asymmetric int8 one; vLLM's int8
  emulation is symmetric), and only since vllm#44025 (merged 2026-05-29); older releases assert "Only symmetric
  quantization is supported for MoE".
- FP8 experts (``CompressedTensorsW8A8Fp8MoEMethod``) take per-tensor weights with per-tensor inputs, per-channel
  weights with dynamic per-token inputs, or blocks (I a multiple of the block's rows, since gate and up are merged);
  the FP8 MoE oracle picks FlashInfer, DeepGEMM, CUTLASS, Triton and, below sm89, FP8 Marlin (weight-only). FP8
  weights with 16-bit inputs have no MoE method at all.
- INT8 W8A8 experts (``CompressedTensorsW8A8Int8MoEMethod``): per-channel symmetric weights, dynamic per-token
  inputs, Triton's int8 fused MoE.
- W4AFP8 experts (``CompressedTensorsW4A8Fp8MoEMethod``, ``_is_fp8_w4a8_sm90``: compute capability exactly 9.0):
  symmetric, groups a multiple of 128, H and I multiples of 256 (CUTLASS ``reorder_tensor``); on other GPUs the
  scheme matches the CPU-only W4A8-int method, which raises.
- NVFP4 (``CompressedTensorsW4A4Nvfp4MoEMethod``, inputs NVFP4 or 16-bit), MXFP4 (``..W4A4Mxfp4MoEMethod``) and MXFP8
  (``..W8A8Mxfp8MoEMethod``) are dispatched on the weights alone: FP4 kernels on Blackwell, Marlin (weight-only)
  below. The MXFP4 oracle's default backends keep the inputs in 16 bits even for an MXFP4-input checkpoint; the
  MXFP8 method quantizes the inputs to MXFP8 on Blackwell even for an MXFP8A16 checkpoint.

gpt-oss: vLLM's gpt_oss model builds its fused-MoE layer with ``has_bias=True`` and ``activation="swigluoai"`` (the
clamped SwiGLU), and picks the quantization method by the same ``get_moe_method``; the rules above apply unchanged
(the expert biases stay float beside the packed weights). The hub model's hidden size 2880 is not a multiple of the
Marlin MoE tile (128), so integer experts of gpt-oss-20b/120b are refused here (vLLM pads gpt-oss's hidden size on
its MXFP4 path only). Beyond the kernel rules, vLLM's gpt_oss ``load_weights`` (docs of 2026-09) sends every checkpoint
that is neither MXFP4 nor Quark to ``_load_weights_other``, which reads the experts fused (3-D ``w13_weight`` /
``w2_weight`` and biases) or per expert under fused parameter names through its streamed-expert suffix table; per-expert
``gate_proj`` / ``up_proj`` / ``down_proj`` with ``weight_packed``, as quantkit and llm-compressor write them, are not
in that table (a third-party plugin, zentorch, patches packed suffixes in). So vLLM's rows for a gpt-oss checkpoint
give the kernel only: the loader does not take integer gpt-oss experts yet, and quantkit's runtime serves them.

Sources (read 2026-11, vLLM main after vllm#44025): ``model_executor/layers/quantization/compressed_tensors/``
``compressed_tensors_moe/compressed_tensors_moe.py`` (``get_moe_method``) and the method files beside it
(``..._wna16_marlin.py``, ``..._wna16.py``, ``..._humming.py``, ``..._w8a8_fp8.py``, ``..._w8a8_int8.py``,
``..._w4a8_fp8.py``, ``..._w4a8_int8.py``, ``..._w4a4_nvfp4.py``, ``..._w4a4_mxfp4.py``, ``..._w8a8_mxfp8.py``),
``compressed_tensors.py`` (``_is_wNa16_group_channel``, ``_is_fp8_w8a8``, ``_is_fp8_w4a8_sm90``,
``_is_dynamic_token_w4a8_int``), ``quantization/utils/marlin_utils.py`` (``check_moe_marlin_supports_layer``),
``quantization/utils/flashinfer_mxint4_moe.py`` (FlashInfer's int4 MoE is opt-in, ``VLLM_USE_FLASHINFER_MOE_INT4``),
``fused_moe/experts/marlin_moe.py``, ``fused_moe/experts/int8_emulation_moe.py`` and the backend priority lists in
``fused_moe/oracle/int_wna16.py``, ``oracle/fp8.py``, ``oracle/mxfp4.py``. Tensor parallelism 1, no expert parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.format.engines import Support
from quantkit.format.float_engines import CAPABILITIES, WEIGHT_ONLY, capability_column, family, takes_float_rules
from quantkit.format.scheme import QuantScheme

MOE_INT_BITS = (4, 8)  # CompressedTensorsWNA16MarlinMoEMethod: "only supports int4 and int8"
MARLIN_MOE_GROUPS = (-1, 32, 64, 128)  # check_moe_marlin_supports_layer
MARLIN_MOE_HIDDEN = 128  # the Marlin MoE kernel's tile along H (gate/up's K, down's N)
MARLIN_MOE_TILE = 64  # along I; without act-order vLLM pads I to it, with act-order it must hold as stored
W4A8_MOE_GROUP = 128  # CompressedTensorsW4A8Fp8MoEMethod: "Only multiple of 128 is supported"
W4A8_MOE_SHAPE = 256  # CUTLASS reorder_tensor: H and I multiples of 256
ZERO_POINTS_SINCE = "vllm#44025, vLLM from mid-2026"  # asymmetric int4 experts in the Marlin MoE kernel
HUMMING_MOE = "the optional humming-kernels package"  # vLLM's Humming MoE backend, for other bit widths
# a group targeting "Linear" is aliased to the fused layer; other targets must match these names of expert 0
VLLM_EXPERT_LOOKUP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class MoERefusal:
    """Why vLLM's fused-MoE layer cannot hold experts of a scheme, and what to do instead."""

    reason: str
    fix: str


_INT_FIX = "use W4A16 or W8A16 for the experts"
_GROUP_FIX = "use group size 128, 64 or 32, or per-channel, for the experts"
_FLOAT_FIX = "keep the experts in float (--ignore) or use an FP8 preset for them"
_W4A8_FIX = "use W4A16 for the experts"

# scheme family -> (sm80, sm90, sm100): the MoE kernel vLLM runs, None where no MoE method loads the experts
_MOE_KERNELS: dict[str, tuple[str | None, str | None, str | None]] = {
    "int": ("Marlin MoE",) * 3,
    "int-zp": (f"Marlin MoE, zero points ({ZERO_POINTS_SINCE})",) * 3,
    "int8": ("Triton INT8 MoE",) * 3,
    "w4afp8": (None, "CUTLASS W4A8 MoE", None),
    "fp8": (f"FP8 Marlin MoE ({WEIGHT_ONLY})", "CUTLASS FP8 MoE", "FlashInfer FP8 MoE"),
    "fp8-block": (f"FP8 Marlin MoE ({WEIGHT_ONLY})", "Triton block FP8 MoE", "FlashInfer / DeepGEMM block FP8 MoE"),
    "nvfp4": (f"FP4 Marlin MoE ({WEIGHT_ONLY})",) * 2 + ("FlashInfer / CUTLASS FP4 MoE",),
    "nvfp4-a16": ("FP4 Marlin MoE",) * 3,
    "mxfp4": (f"MXFP4 Marlin MoE ({WEIGHT_ONLY})",) * 2 + (f"FlashInfer MXFP4 MoE ({WEIGHT_ONLY})",),
    "mxfp4-a16": ("MXFP4 Marlin MoE",) * 2 + ("FlashInfer MXFP4 MoE",),
    "mxfp8": (f"MXFP8 Marlin MoE ({WEIGHT_ONLY})",) * 2 + ("FlashInfer MXFP8 MoE",),
    "mxfp8-a16": ("MXFP8 Marlin MoE",) * 2 + ("FlashInfer MXFP8 MoE (quantizes the 16-bit inputs to MXFP8)",),
}
_HOPPER_ONLY = MoERefusal(
    "int4 experts with FP8 activations run on Hopper only (CUTLASS W4A8 MoE, compute capability exactly 9.0; "
    "elsewhere they match vLLM's CPU-only W4A8-int MoE method, which raises)",
    _W4A8_FIX,
)


def moe_method(scheme: QuantScheme) -> str:
    """The compressed-tensors MoE method ``get_moe_method`` picks for experts of this scheme (the class name without
    ``CompressedTensors`` and ``MoEMethod``); "none" where no branch matches."""
    acts = scheme.activations
    if scheme.is_float:
        if scheme.scale_format == "e8m0":
            return "W4A4Mxfp4" if scheme.bits == 4 else "W8A8Mxfp8"
        if scheme.scale_format == "fp8":
            return "W4A4Nvfp4"
        return "W8A8Fp8" if acts is not None and acts.type == "float" and acts.bits == 8 else "none"
    if acts is None:
        return "WNA16Marlin" if scheme.bits in MOE_INT_BITS else "Humming"
    if acts.type == "int":
        return "W8A8Int8" if scheme.bits == 8 else "W4A8Int8 (CPU only)"
    return "W4A8Fp8" if scheme.bits == 4 and acts.bits == 8 else "none"


def _moe_family(scheme: QuantScheme) -> str:
    """The row of the MoE kernel table (call after :func:`_scheme_refusal` found none)."""
    if not takes_float_rules(scheme):
        return "int" if scheme.symmetric else "int-zp"
    return family(scheme)


def _scheme_refusal(scheme: QuantScheme) -> MoERefusal | None:
    """Refusals that depend on the scheme alone, on every GPU."""
    acts, bits, group = scheme.activations, scheme.bits, scheme.group_size
    if scheme.is_float:
        if scheme.scale_format == "fp8" and acts is not None and acts.scale_format != "fp8":
            return MoERefusal("NVFP4 experts take NVFP4 or 16-bit inputs only", "use NVFP4 or NVFP4A16")
        if scheme.scale_format != "native":
            return None
        if acts is None:
            return MoERefusal(
                "FP8 experts with 16-bit inputs (vLLM's MoE dispatch has no W8A16-FP8 method)",
                "use FP8_DYNAMIC or W8A16 for the experts",
            )
        per_tensor = scheme.per_tensor and acts.strategy == "tensor"
        per_channel = scheme.per_channel and acts.strategy == "token" and acts.dynamic is True
        if not (per_tensor or per_channel or scheme.block):
            return MoERefusal(
                "FP8 experts need per-tensor weights and inputs, per-channel weights with dynamic per-token inputs, "
                "or blocks",
                "use FP8, FP8_DYNAMIC or FP8_BLOCK for the experts",
            )
        return None
    if acts is not None:
        if acts.type == "int" and bits == 8:
            if scheme.per_channel and scheme.symmetric and acts.strategy == "token" and acts.dynamic is True:
                return None
            return MoERefusal(
                "INT8 experts need symmetric per-channel weights and dynamic per-token inputs",
                "use W8A8 for the experts",
            )
        if acts.type == "float" and acts.bits == 8 and bits == 4:
            if not scheme.symmetric or (scheme.act_order and not scheme.static_groups):
                return MoERefusal("W4AFP8 experts must be symmetric, without dynamic act-order groups", _W4A8_FIX)
            if group <= 0 or group % W4A8_MOE_GROUP:
                return MoERefusal(f"W4AFP8 experts need groups a multiple of {W4A8_MOE_GROUP}", _W4A8_FIX)
            return None
        return MoERefusal(
            f"no MoE method for {scheme.name} experts (the W4A8-int one, the only other integer method, is CPU-only)",
            _INT_FIX,
        )
    if bits not in MOE_INT_BITS:
        why = f"{bits}-bit experts (the Marlin MoE kernel takes int4 and int8; other widths need {HUMMING_MOE})"
        return MoERefusal(why, _INT_FIX)
    if not scheme.symmetric and bits == 8:
        return MoERefusal(
            "asymmetric int8 experts (the Marlin MoE kernel keeps zero points for int4 only)",
            "use symmetric int8 (W8A16) or W4A16_ASYM for the experts",
        )
    if group not in MARLIN_MOE_GROUPS:
        return MoERefusal(f"group size {group} (the Marlin MoE kernel takes -1, 32, 64 and 128)", _GROUP_FIX)
    return None


def _shape_refusal(scheme: QuantScheme, hidden: int | None, inter: int | None) -> MoERefusal | None:
    """Refusals that depend on the experts' hidden size H and width I (each checked when given)."""
    name = _moe_family(scheme)
    if name in ("int", "int-zp"):
        if hidden is not None and hidden % MARLIN_MOE_HIDDEN:
            why = f"hidden size {hidden} is not a multiple of {MARLIN_MOE_HIDDEN} (the Marlin MoE kernel's tile)"
            return MoERefusal(why, _FLOAT_FIX)
        group = scheme.group_size
        for dim, size in (("hidden size", hidden), ("expert width", inter)):
            if size is not None and group > 0 and size % group:
                return MoERefusal(f"group size {group} does not divide the {dim} {size}", _GROUP_FIX)
        tile = max(MARLIN_MOE_TILE, group)
        # vLLM counts act-order only on grouped weights (actorder "group"; static groups are written as "weight")
        dynamic_groups = scheme.act_order and not scheme.static_groups and group > 0
        if dynamic_groups and inter is not None and inter % tile:
            why = f"dynamic act-order groups need the expert width {inter} to be a multiple of {tile}"
            return MoERefusal(why, "use static act-order groups (or none) for the experts")
    if name == "w4afp8":
        for dim, size in (("hidden size", hidden), ("expert width", inter)):
            if size is not None and size % W4A8_MOE_SHAPE:
                why = f"W4AFP8 experts need the {dim} {size} to be a multiple of {W4A8_MOE_SHAPE}"
                return MoERefusal(why, _W4A8_FIX)
    if name == "fp8-block" and inter is not None and inter % scheme.block:
        why = f"block size {scheme.block} does not divide the expert width {inter} (gate and up are merged)"
        return MoERefusal(why, "use FP8_DYNAMIC for the experts")
    return None


def _refusal(scheme: QuantScheme, capability: int, hidden: int | None, inter: int | None) -> MoERefusal | None:
    refusal = _scheme_refusal(scheme) or _shape_refusal(scheme, hidden, inter)
    if refusal is None and _MOE_KERNELS[_moe_family(scheme)][capability_column(capability)] is None:
        return _HOPPER_ONLY
    return refusal


def vllm_moe_kernel(
    scheme: QuantScheme, capability: int, hidden_size: int | None = None, intermediate_size: int | None = None
) -> Support:
    """The fused-MoE kernel vLLM runs a layer's routed experts of this scheme with on a GPU of this compute capability
    (hidden size and expert width, where given, checked against the kernel's tiles)."""
    refusal = _refusal(scheme, capability, hidden_size, intermediate_size)
    if refusal is not None:
        return Support(None, refusal.reason)
    kernel = _MOE_KERNELS[_moe_family(scheme)][capability_column(capability)]
    return Support(kernel, fast=kernel is not None and WEIGHT_ONLY not in kernel)


def moe_refusal(
    scheme: QuantScheme, hidden_size: int | None = None, intermediate_size: int | None = None
) -> MoERefusal | None:
    """Why no GPU generation vLLM serves (sm80, sm90, sm100) loads experts of this scheme; None when one does."""
    refusals = [_refusal(scheme, c, hidden_size, intermediate_size) for c in CAPABILITIES]
    return refusals[0] if all(refusals) else None


def moe_layout_problem(
    scheme: QuantScheme, hidden_size: int | None = None, intermediate_size: int | None = None
) -> str | None:
    """One line naming why vLLM's fused-MoE layer cannot load a layer's routed experts of this scheme, and the fix;
    None when it loads them on at least one GPU generation (W4AFP8: Hopper). For an expert linear, ``hidden_size``
    is gate/up's in-features (down's out-features) and ``intermediate_size`` gate/up's out-features (down's
    in-features); without them only the scheme is checked. Compressed-tensors' own layout rules
    (:func:`~quantkit.format.engines.layout_problem`) apply on top."""
    refusal = moe_refusal(scheme, hidden_size, intermediate_size)
    if refusal is None:
        return None
    return f"vLLM's fused-MoE layer cannot load {scheme.name} experts: {refusal.reason}; {refusal.fix}"
