"""How a scheme reads to a person: the weight format ("NVFP4 g16, FP8 scales + global"), the activation scheme
("FP8 dynamic per-token") and the KV cache ("FP8, static per-tensor k/v scales"), as ``inspect`` and the docs' preset
table show them. Short names (:attr:`QuantScheme.name`) stay the machine-stable spelling."""

from __future__ import annotations

from quantkit.format.scheme import ActivationScheme, KVCacheScheme, QuantScheme

_GRANULARITY = {"token": "per-token", "tensor": "per-tensor"}


def weight_format(scheme: QuantScheme) -> str:
    """E.g. ``FP8 e4m3 per-channel``, ``FP8 e4m3 128x128 blocks``, ``NVFP4 g16, FP8 scales + global``,
    ``MXFP4 g32, E8M0 scales``, ``INT4 g128 asym``."""
    if not scheme.is_float:
        group = "per-channel" if scheme.per_channel else f"g{scheme.group_size}"
        return f"INT{scheme.bits} {group} {'sym' if scheme.symmetric else 'asym'}"
    if scheme.scale_format == "fp8":
        return f"NVFP4 g{scheme.group_size}, FP8 scales + global"
    if scheme.scale_format == "e8m0":
        return f"MXFP{scheme.bits} g{scheme.group_size}, E8M0 scales"
    if scheme.block:
        return f"FP8 e4m3 {scheme.block}x{scheme.block} blocks"
    return f"FP8 e4m3 {'per-tensor' if scheme.per_tensor else 'per-channel'}"


def activation_format(acts: ActivationScheme | None) -> str:
    """E.g. ``16-bit`` (weight-only), ``FP8 dynamic per-token``, ``FP8 static per-tensor``, ``INT8 dynamic
    per-token``, ``FP4 g16 dynamic, static global`` (NVFP4), ``FP8 dynamic g128``."""
    if acts is None:
        return "16-bit"
    kind = f"INT{acts.bits}" if acts.type == "int" else f"FP{acts.bits}"
    if acts.dynamic == "local":  # NVFP4: group scales per call under a global scale calibrated once
        return f"{kind} g{acts.group_size} dynamic, static global"
    how = "dynamic" if acts.dynamic else "static"
    return f"{kind} {how} {_GRANULARITY.get(acts.strategy, f'g{acts.group_size}')}"


def kv_cache_format(kv: KVCacheScheme | None) -> str:
    """E.g. ``16-bit``, ``FP8, static per-tensor k/v scales``, ``FP8, static per-KV-head k/v scales``."""
    if kv is None:
        return "16-bit"
    return f"FP8, static {'per-tensor' if kv.strategy == 'tensor' else 'per-KV-head'} k/v scales"
