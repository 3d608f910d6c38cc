"""Which vLLM kernel runs a float or activation-quantized scheme (the presets FP8, FP8_DYNAMIC, FP8_BLOCK, W8A8,
W4AFP8, NVFP4(A16), MXFP4(A16), MXFP8(A16)) and an FP8 KV cache, per GPU generation: the part of the engine table
(:mod:`quantkit.format.engines`, which holds the layout rules every engine shares) for these schemes.

vLLM picks a compressed-tensors scheme class from the config group (``_get_scheme_from_parts``), then the scheme
picks a kernel from a priority table, the first whose ``is_supported`` / ``can_implement`` pass. What that gives on
Ampere (sm80), Hopper (sm90) and Blackwell (sm100), at tensor parallelism 1:

- FP8 weights with FP8 activations (``CompressedTensorsW8A8Fp8``, ``get_min_capability`` 89): CUTLASS FP8 scaled-mm
  (FlashInfer's first where it implements the layer, on sm100); below sm89 the dispatcher swaps in
  ``CompressedTensorsW8A16Fp8``, FP8 Marlin, which leaves the activations in 16 bits. Block scales (FP8_BLOCK) take
  the block table instead: DeepGEMM / CUTLASS block FP8, Triton last.
- INT8 W8A8 (``CompressedTensorsW8A8Int8``): CUTLASS int8 scaled-mm from sm75, Triton behind it.
- W4AFP8 (``CompressedTensorsW4A8Fp8``): only where ``_is_fp8_w4a8_sm90`` holds (compute capability exactly 9.0,
  CUTLASS W4A8); elsewhere no scheme matches and vLLM refuses the checkpoint.
- NVFP4 (``CompressedTensorsW4A4Fp4``): the NVFP4 table (FlashInfer CUTLASS, CUTLASS FP4, Marlin, ...); native FP4
  needs sm100, below it FP4 Marlin dequantizes the weights and leaves the activations in 16 bits. NVFP4A16
  (``CompressedTensorsW4A16Fp4``) is FP4 Marlin everywhere (sm80 up).
- MXFP4 (``CompressedTensorsW4A4MxFp4``): ``init_mxfp4_linear_kernel`` tries FlashInfer MXFP4 (sm100) then MXFP4
  Marlin (weight-only); MXFP4A16 (``CompressedTensorsW4A16Mxfp4``, min 80) is FP4 Marlin.
- MXFP8 (``CompressedTensorsW8A8Mxfp8``): FlashInfer CUTLASS MXFP8 (sm100), then MXFP8 Marlin, then emulation.
- The FP8 KV cache (``CompressedTensorsKVCacheMethod``): strategies ``tensor`` and ``attn_head``; ``attn_head``
  asserts ``supports_per_head_quant_scales``, which only FlashAttention 3 (Hopper) sets. FlashAttention 2 has no
  FP8 cache, so on Ampere vLLM takes FlashInfer or Triton attention; Blackwell's default is FlashInfer.

Sources (read 2026-11, vLLM :data:`~quantkit.format.engines.VLLM_VERSION`):
``model_executor/layers/quantization/compressed_tensors/compressed_tensors.py`` (``_get_scheme_from_parts``,
``_is_fp8_w4a8_sm90``, ``CompressedTensorsKVCacheMethod``), ``schemes/compressed_tensors_w8a8_fp8.py``,
``schemes/compressed_tensors_w8a8_int8.py``, ``schemes/compressed_tensors_w4a4_nvfp4.py``,
``schemes/compressed_tensors_w4a16_nvfp4.py``, ``schemes/compressed_tensors_w4a4_mxfp4.py``,
``schemes/compressed_tensors_w4a16_mxfp4.py``, ``schemes/compressed_tensors_w8a8_mxfp8.py``,
``model_executor/kernels/linear/__init__.py`` (the priority tables), ``utils/fp8_utils.py``
(``validate_fp8_block_shape``), ``v1/attention/backends/flash_attn.py`` (``supports_per_head_quant_scales``).
"""

from __future__ import annotations

from quantkit.format.scheme import KVCacheScheme, QuantScheme

AMPERE, HOPPER, BLACKWELL = 80, 90, 100  # the compute capabilities inspect and the docs report vLLM's kernels for
CAPABILITIES = (AMPERE, HOPPER, BLACKWELL)
CAPABILITY_NAMES = {AMPERE: "Ampere", HOPPER: "Hopper", BLACKWELL: "Blackwell"}
WEIGHT_ONLY = "weight-only: activations stay 16-bit"  # a fallback that drops the checkpoint's activation scheme

# scheme family -> (sm80, sm90, sm100): the kernel vLLM picks, None where no compressed-tensors scheme matches
_KERNELS: dict[str, tuple[str | None, str | None, str | None]] = {
    "fp8": (f"FP8 Marlin ({WEIGHT_ONLY})", "CUTLASS FP8", "FlashInfer / CUTLASS FP8"),
    "fp8-block": (f"FP8 Marlin ({WEIGHT_ONLY})", "DeepGEMM / CUTLASS block FP8", "FlashInfer / DeepGEMM block FP8"),
    "fp8-a16": ("FP8 Marlin", "FP8 Marlin", "FP8 Marlin"),
    "int8": ("CUTLASS INT8", "CUTLASS INT8", "CUTLASS INT8"),
    "w4afp8": (None, "CUTLASS W4A8", None),
    "nvfp4": (f"FP4 Marlin ({WEIGHT_ONLY})", f"FP4 Marlin ({WEIGHT_ONLY})", "FlashInfer CUTLASS FP4"),
    "nvfp4-a16": ("FP4 Marlin", "FP4 Marlin", "FP4 Marlin"),
    "mxfp4": (f"MXFP4 Marlin ({WEIGHT_ONLY})", f"MXFP4 Marlin ({WEIGHT_ONLY})", "FlashInfer MXFP4"),
    "mxfp4-a16": ("MXFP4 Marlin", "MXFP4 Marlin", "MXFP4 Marlin"),
    "mxfp8": (f"MXFP8 Marlin ({WEIGHT_ONLY})", f"MXFP8 Marlin ({WEIGHT_ONLY})", "FlashInfer CUTLASS MXFP8"),
    "mxfp8-a16": ("MXFP8 Marlin", "MXFP8 Marlin", "MXFP8 Marlin"),
}
_REFUSALS = {
    "w4afp8": "int4 weights with FP8 activations run on Hopper only (CUTLASS W4A8, compute capability exactly 9.0)",
}
_KV_KERNELS = {  # the attention backends that keep an FP8 cache under the checkpoint's k/v scales
    "tensor": ("FlashInfer / Triton attention", "FlashAttention 3", "FlashInfer"),
    "attn_head": (None, "FlashAttention 3", None),
}
_KV_REFUSAL = "per-head KV scales need FlashAttention 3 (supports_per_head_quant_scales), Hopper only"
# FP8_BLOCK's block_n: vLLM merges q/k/v and gate/up into one matrix, and every merged part but the last must be
# whole 128-row blocks (validate_fp8_block_shape), or the merged scale rows straddle two linears
MERGED_PARTS_RULE = "every merged part but the last (q and k of q/k/v, gate of gate/up) needs whole blocks of rows"
# the linears vLLM loads into a merged matrix ahead of another (its packed_modules_mapping: qkv_proj, gate_up_proj)
MERGED_AHEAD = ("q_proj", "k_proj", "gate_proj")


def merged_ahead(layer: str) -> bool:
    """Whether vLLM merges this linear (by its full name) with a following one."""
    return layer.rsplit(".", 1)[-1] in MERGED_AHEAD


def takes_float_rules(scheme: QuantScheme) -> bool:
    """Whether vLLM loads the scheme outside its integer weight-only (WNA16) path: float weights, or quantized
    activations."""
    return scheme.is_float or scheme.activations is not None


def family(scheme: QuantScheme) -> str:
    """The row of the kernel table a float or activation-quantized scheme falls in."""
    acts = scheme.activations
    if not scheme.is_float:
        return "int8" if acts is not None and acts.type == "int" and scheme.bits == 8 else "w4afp8"
    if scheme.bits == 4:
        kind = "mxfp4" if scheme.scale_format == "e8m0" else "nvfp4"
    elif scheme.scale_format == "e8m0":
        kind = "mxfp8"
    else:
        kind = "fp8-block" if scheme.block else "fp8"
    return kind if acts is not None else f"{kind}-a16"


def float_kernel(scheme: QuantScheme, capability: int) -> tuple[str | None, str]:
    """(kernel, why not) for a float or activation-quantized scheme on a GPU of this compute capability; the layer's
    layout is checked by the caller (:func:`quantkit.format.engines.vllm_kernel`)."""
    name = family(scheme)
    if name not in _KERNELS:  # FP8 weights with 16-bit activations and tensor or block scales: as FP8 Marlin
        name = "fp8-a16"
    kernel = _KERNELS[name][capability_column(capability)]
    return kernel, "" if kernel else _REFUSALS.get(name, f"no kernel for {scheme.name}")


def kv_cache_kernel(kv: KVCacheScheme, capability: int) -> tuple[str | None, str]:
    """(attention backend, why not) of an FP8 KV cache with the checkpoint's scales."""
    kernel = _KV_KERNELS[kv.strategy][capability_column(capability)]
    return kernel, "" if kernel else _KV_REFUSAL


def capability_column(capability: int) -> int:
    """The table column of a compute capability: the newest generation at or below it (sm89 reads as Ampere's
    column, which is conservative for FP8: vLLM runs CUTLASS FP8 from sm89)."""
    if capability < AMPERE:
        raise ValueError(f"quantkit reports vLLM kernels from sm{AMPERE} up, not sm{capability}")
    return sum(capability >= c for c in CAPABILITIES) - 1
