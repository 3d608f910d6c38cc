"""What the engines that load quantkit's output accept, per Linear layer: the one table of those rules.

Two kinds of rule:

- the *layout* (:func:`layout_problem`): a group size that does not divide a layer's in-features K leaves a
  short last group; quantkit reads it, but compressed-tensors refuses it ("tensor column shape must be
  divisible by the given group_size", on decompress too since 0.20), so transformers does, and vLLM refuses it
  (``verify_group_size_divides_partition``). Act-order with dynamic groups (``actorder: group``, a g_idx per
  layer) is refused by compressed-tensors 0.20 when it parses the config. quantize, plan and recipes refuse
  such layouts unless told otherwise (:data:`LAYOUT_POLICIES`);
- the *kernels* of each engine for a valid layout (:func:`vllm_kernel`, :func:`gptq_support`,
  :func:`gguf_type`): shown by ``quantkit inspect`` and checked by the exports.

Sources (read 2026-11): vLLM :data:`VLLM_VERSION` ``compressed_tensors_wNa16.py`` and ``kernels/linear/__init__.py``
(kernel order CutlassW4A8, Machete, Marlin, Conch, Exllama, TritonW4A16, Humming; the first whose ``can_implement``
passes), each kernel's ``can_implement``; compressed-tensors 0.20 ``quant_args.py``, ``forward_helpers.py`` and
``pack_quantized``; transformers 5.23 ``quantizer_compressed_tensors.py``; llama.cpp ``ggml-common.h``.
Tensor parallelism 1 is assumed (each partition is the whole N or K).

Float and activation-quantized schemes (FP8, NVFP4, MX formats, W8A8, W4AFP8) add layout rules here and take their
kernels from :mod:`quantkit.format.float_engines`. compressed-tensors 0.20 quantizes grouped tensors, weights and
activations alike, only in whole groups (``forward_helpers._process_group``: "tensor column shape must be divisible
by the given group_size"), so K must be a multiple of NVFP4's 16 and the MX formats' 32, and of FP8_BLOCK's 128
(its activations are grouped by 128 along K, and vLLM's ``per_token_group_quant_fp8`` asserts it); FP4 codes pack
two to a byte (``nvfp4/helpers.py``: "an even number of columns"). Those group sizes are the format's, so no layout
policy changes them (:func:`format_fixes_group`): the layer is kept in float (``--ignore``) or another preset taken.
Block weights' rows are padded by compressed-tensors (``maybe_pad_tensor_for_block_quant``), but vLLM merges fused
linears (:data:`~quantkit.format.float_engines.MERGED_PARTS_RULE`, :func:`merged_rows_problem`).

The weights outside the blocks (a quantized head, a quantized embedding) have their rules in
:mod:`quantkit.format.outer_engines`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantkit.format.float_engines import HOPPER, MERGED_PARTS_RULE, float_kernel, kv_cache_kernel, takes_float_rules
from quantkit.format.quantization_config import COMPRESSED_TENSORS_FORMAT
from quantkit.format.scheme import KVCacheScheme, QuantScheme

FALLBACK_GROUP_SIZES = (128, 64, 32)  # the group sizes every engine's kernels take, largest first
STRICT, FALLBACK, QUANTKIT_ONLY = "strict", "fallback", "quantkit-only"
LAYOUT_POLICIES = (STRICT, FALLBACK, QUANTKIT_ONLY)
LAYOUT_POLICY_HELP = (
    "fallback: a smaller group size on the layers whose in-features the group size does not divide (g128 -> g64 "
    "-> g32 -> channel), said in one line; strict: refuse layouts compressed-tensors, transformers or vLLM would "
    "refuse; quantkit-only: write short last groups and dynamic act-order groups, which only quantkit reads."
)

DENSE_PACKING_SINCE = "0.18"  # compressed-tensors packs 3/5/6/7-bit values densely (as quantkit) from 0.18 on
# the transformers releases quantkit supports: pyproject.toml's pin (tests/format/test_engines.py checks they agree);
# transformers loads compressed-tensors checkpoints through the compressed-tensors package
TRANSFORMERS_VERSIONS = ">=5.17,<5.23"
# the compressed-tensors releases that read every layout quantkit writes: the one whose format it writes, and later
COMPRESSED_TENSORS_SINCE = COMPRESSED_TENSORS_FORMAT.rsplit(".", 1)[0]
TRANSFORMERS_RANGE = f"transformers {TRANSFORMERS_VERSIONS} with compressed-tensors >={COMPRESSED_TENSORS_SINCE}"
TRANSFORMERS_BROKEN = {
    "5.23 and 5.24": "refuse asymmetric checkpoints (zero-point shape check) and decode mixed checkpoints with "
    "dequantize=True using the first group's scheme",
}
VLLM_VERSION = "0.33"  # the vLLM release whose source the kernel rules below were read from

_MACHETE_GROUPS = (-1, 64, 128)
_MARLIN_GROUPS = (-1, 32, 64, 128)
_CONCH_GROUPS = (-1, 128)
_TRITON_GROUPS = (-1, 32, 64, 128, 256)
GPTQ_BITS = (2, 4, 8)  # the GPTQ v1 packings quantkit exports (3-bit GPTQ packs across words differently)
GPTQ_MARLIN_GROUPS = _MARLIN_GROUPS
GGUF_BLOCK = 32  # Q4_0 / Q4_1 / Q8_0 hold 32 weights per block, one fp16 scale (and offset) each


# --------------------------------------------------------------------------------------------------
# Layout: what compressed-tensors (and so transformers and vLLM) accept at all
# --------------------------------------------------------------------------------------------------


def layout_problem(scheme: QuantScheme, in_features: int) -> str | None:
    """Why compressed-tensors (and so transformers and vLLM) would refuse this layer's layout; None when valid."""
    if scheme.group_size > 0 and in_features % scheme.group_size:
        return f"group size {scheme.group_size} does not divide its {in_features} in-features"
    if scheme.block and in_features % scheme.block:
        return f"block size {scheme.block} does not divide its {in_features} in-features"
    acts = scheme.activations
    if acts is not None and acts.group_size and in_features % acts.group_size:
        return f"input groups of {acts.group_size} do not divide its {in_features} in-features"
    if scheme.is_float and scheme.bits == 4 and in_features % 2:
        return f"FP4 codes pack two to a byte, and its {in_features} in-features are odd"
    if scheme.act_order and not scheme.static_groups:
        return "act-order with dynamic groups (actorder 'group', a g_idx per layer)"
    return None


def format_fixes_group(scheme: QuantScheme) -> bool:
    """Whether the format fixes the group size (NVFP4's 16, MX's 32, FP8_BLOCK's 128 blocks): the fallback layout
    policy cannot give such a layer a smaller group, so a layer the group does not fit is an error."""
    return scheme.is_float and (scheme.group_size > 0 or scheme.block > 0)


def merged_rows_problem(scheme: QuantScheme, out_features: int) -> str | None:
    """Why vLLM refuses a linear it merges with the next one of its fused group (q and k of q/k/v, gate of gate/up):
    under block scales its out-features must be whole blocks; None when they are (or the scheme has no blocks)."""
    if scheme.block and out_features % scheme.block:
        return f"block size {scheme.block} does not divide its {out_features} out-features ({MERGED_PARTS_RULE})"
    return None


def layout_fix(scheme: QuantScheme) -> str:
    """What to do about a layer a float preset cannot hold, for an error message."""
    return (
        f"keep it in float with --ignore, or pick a preset whose group fits (the {scheme.name} group is the "
        "format's, no layout policy changes it)"
    )


def fallback_scheme(scheme: QuantScheme, in_features: int) -> QuantScheme:
    """The largest engine-valid group size below ``scheme``'s that divides ``in_features`` (per-channel if none)."""
    for size in FALLBACK_GROUP_SIZES:
        if size < scheme.group_size and in_features % size == 0:
            return dataclasses.replace(scheme, group_size=size)
    return dataclasses.replace(scheme, group_size=-1)


def widest_dividing_group(in_features: list[int]) -> int:
    """The largest engine-valid group size that divides every in-features given (-1: none does)."""
    return next((size for size in FALLBACK_GROUP_SIZES if all(k % size == 0 for k in in_features)), -1)


def group_label(scheme: QuantScheme) -> str:
    return "channel" if scheme.per_channel else f"g{scheme.group_size}"


# --------------------------------------------------------------------------------------------------
# Kernels: which one each engine runs a valid layout with
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Support:
    """One engine's verdict on one layer: ``kernel`` when it loads (e.g. "Marlin", "Q4_0"), else ``reason``."""

    kernel: str | None
    reason: str = ""
    fast: bool = True  # False: only a fallback kernel, or one from an optional package

    @property
    def loads(self) -> bool:
        return self.kernel is not None

    @property
    def label(self) -> str:
        return self.kernel if self.kernel is not None else f"refused: {self.reason}"


def transformers_support(scheme: QuantScheme, in_features: int) -> Support:
    problem = layout_problem(scheme, in_features)
    if problem:
        return Support(None, problem)
    dense = scheme.bits not in (1, 2, 4, 8)  # packed across word boundaries: older releases padded each word
    return Support(f"loads (compressed-tensors >={DENSE_PACKING_SINCE})" if dense else "loads")


def vllm_kernel(
    scheme: QuantScheme, out_features: int, in_features: int, capability: int, merged_ahead: bool = False
) -> Support:
    """The kernel vLLM's compressed-tensors scheme picks for a layer on a GPU of this compute capability: WNA16's
    kernel table for integer weight-only schemes, :mod:`quantkit.format.float_engines` for the others;
    ``merged_ahead``: vLLM merges the layer with a following one (q, k; gate)."""
    problem = layout_problem(scheme, in_features) or (merged_ahead and merged_rows_problem(scheme, out_features))
    if problem:
        return Support(None, problem)
    if takes_float_rules(scheme):
        kernel, reason = float_kernel(scheme, capability)
        return Support(kernel, reason, fast=kernel is not None and "weight-only" not in kernel)
    bits, sym, group = scheme.bits, scheme.symmetric, scheme.group_size
    if not sym and bits not in (4, 8):
        return Support(None, f"asymmetric {bits}-bit weights (vLLM takes zero points for 4 and 8 bits only)")
    if bits in (4, 8):
        if capability == HOPPER and group in _MACHETE_GROUPS and in_features % 64 == 0 and out_features % 128 == 0:
            return Support("Machete")
        if capability >= 75 and group in _MARLIN_GROUPS and (sym or bits == 4):
            return Support("Marlin")
        if capability >= 80 and group in _CONCH_GROUPS:
            return Support("Conch (optional conch-triton-kernels package)", fast=False)
        if bits == 4 and group in (*_TRITON_GROUPS, in_features) and out_features % 8 == 0:
            return Support("TritonW4A16", fast=False)
        if sym and group > 0 and out_features % (32 // bits) == 0:
            return Support("Exllama (fp16 models only)", fast=False)
    if capability >= 75:
        return Support("Humming (optional humming-kernels package; vLLM from mid-2026)", fast=False)
    return Support(None, f"no kernel for {scheme.name} on compute capability {capability / 10:.1f}")


def kv_cache_support(kv: KVCacheScheme, capability: int) -> Support:
    """The attention backend vLLM serves an FP8 KV cache with, under the checkpoint's k/v scales."""
    kernel, reason = kv_cache_kernel(kv, capability)
    return Support(kernel, reason)


def gptq_support(scheme: QuantScheme, in_features: int) -> Support:
    """Whether ``quantkit export --format gptq`` can hold the layer exactly, and vLLM's kernel for the result."""
    if takes_float_rules(scheme):
        return Support(None, f"{scheme.name} (GPTQ v1 holds integer weights with 16-bit activations)")
    if not scheme.symmetric:
        return Support(None, "asymmetric (the GPTQ v1 export writes symmetric schemes)")
    if scheme.bits not in GPTQ_BITS:
        return Support(None, f"{scheme.bits}-bit weights (GPTQ v1 export writes {', '.join(map(str, GPTQ_BITS))} bits)")
    if scheme.act_order and not scheme.static_groups:
        return Support(None, "dynamic act-order groups (the export writes desc_act: false)")
    if not scheme.per_channel and in_features % scheme.group_size:
        return Support(None, f"group size {scheme.group_size} does not divide its {in_features} in-features")
    if scheme.bits in (4, 8) and scheme.group_size in GPTQ_MARLIN_GROUPS:
        return Support("gptq_marlin")
    return Support("gptq (fp16 models only)", fast=False)


def gguf_type(scheme: QuantScheme | None, in_features: int) -> Support:
    """The GGUF block type that holds a layer's codes exactly (F16/BF16 for an unquantized one)."""
    if scheme is None:
        return Support("F16/BF16")
    if scheme.is_float:
        return Support(None, f"{scheme.name} float codes (GGUF blocks hold integer codes)")
    if scheme.act_order and not scheme.static_groups:
        return Support(None, "dynamic act-order groups (GGUF blocks are contiguous)")
    group = in_features if scheme.per_channel else scheme.group_size
    if group % GGUF_BLOCK or in_features % GGUF_BLOCK:
        return Support(None, f"groups of {group} over {in_features} in-features are not whole {GGUF_BLOCK}-blocks")
    if scheme.bits == 4:
        return Support("Q4_0" if scheme.symmetric else "Q4_1")
    if scheme.bits == 8 and scheme.symmetric:
        return Support("Q8_0")
    kind = "symmetric" if scheme.symmetric else "asymmetric"
    return Support(None, f"{kind} {scheme.bits}-bit weights (GGUF holds int4 as Q4_0/Q4_1 and int8 as Q8_0)")


# the exports quantkit writes from a checkpoint's codes, and the per-layer rule of each
EXPORT_SUPPORT = {"gptq": gptq_support, "gguf": gguf_type}
