"""Where a checkpoint loads: every layer's verdict from :mod:`quantkit.format.engines`, summed up per engine."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from quantkit.format.engines import (
    TRANSFORMERS_BROKEN,
    TRANSFORMERS_RANGE,
    VLLM_VERSION,
    Support,
    gguf_type,
    gptq_support,
    kv_cache_support,
    transformers_support,
    vllm_kernel,
)
from quantkit.format.float_engines import CAPABILITIES, CAPABILITY_NAMES, HOPPER, merged_ahead
from quantkit.format.moe_engines import vllm_moe_kernel
from quantkit.format.outer_engines import transformers_embedding, vllm_embedding
from quantkit.format.scheme import KVCacheScheme, QuantScheme


@dataclass(slots=True)
class EngineVerdict:
    engine: str
    loads: bool  # every layer loads
    summary: str  # e.g. "Machete 60, Marlin 150" or "refused: 90 layers (group size 128 does not divide ...)"
    layers: dict[str, str]  # layer -> kernel, or "refused: <reason>"


@dataclass(slots=True, frozen=True)
class LayerShape:
    name: str
    scheme: QuantScheme
    out_features: int
    in_features: int


def vllm_engine(capability: int) -> str:
    """The row name of vLLM on one GPU generation (inspect's table, the docs' columns)."""
    return f"vLLM, {CAPABILITY_NAMES[capability]} (sm{capability}; predicted from vLLM {VLLM_VERSION} source)"


# a routed expert's linear (model.layers.N.<moe>.experts.<e>.<proj>): vLLM loads it in its fused-MoE layer
_EXPERT = re.compile(r"\.experts\.\d+\.(?P<proj>[^.]+)$")
_EXPERT_DOWN = ("down_proj", "w2")  # the expert projection whose in-features are the expert width (Mixtral: w2)


def _vllm_judge(capability: int) -> Callable[[LayerShape], Support]:
    def judge(s: LayerShape) -> Support:
        expert = _EXPERT.search(s.name)
        if expert is None:
            return vllm_kernel(s.scheme, s.out_features, s.in_features, capability, merged_ahead(s.name))
        down = expert["proj"] in _EXPERT_DOWN
        hidden, width = (s.out_features, s.in_features) if down else (s.in_features, s.out_features)
        return vllm_moe_kernel(s.scheme, capability, hidden_size=hidden, intermediate_size=width)

    return judge


# Hopper first: the GPUs most quantkit users serve on
_ENGINES: dict[str, Callable[[LayerShape], Support]] = {
    "transformers": lambda s: transformers_support(s.scheme, s.in_features),
    **{vllm_engine(c): _vllm_judge(c) for c in sorted(CAPABILITIES, key=lambda c: (c != HOPPER, c))},
    "GPTQ v1 (quantkit export)": lambda s: gptq_support(s.scheme, s.in_features),
    "GGUF (quantkit export)": lambda s: gguf_type(s.scheme, s.in_features),
}


def loads_in(
    layers: list[LayerShape], kv_cache: KVCacheScheme | None = None, embedding: LayerShape | None = None
) -> list[EngineVerdict]:
    """One verdict per engine over all quantized layers; with an FP8 KV cache, vLLM's verdicts name the attention
    backend that keeps it too (and refuse where none does); with a quantized embedding, transformers' and vLLM's
    verdicts take its rule (:mod:`quantkit.format.outer_engines`) too."""
    verdicts = [_verdict(engine, judge, layers) for engine, judge in _ENGINES.items()]
    vllm = [(v, c) for c in CAPABILITIES for v in verdicts if v.engine == vllm_engine(c)]
    if kv_cache is not None:
        for verdict, capability in vllm:
            _add_outer(verdict, kv_cache_support(kv_cache, capability), "kv_cache", "KV cache")
    if embedding is not None:
        for verdict in verdicts:
            if verdict.engine == "transformers":
                _add_outer(verdict, transformers_embedding(embedding.scheme), embedding.name, "embedding")
        for verdict, _ in vllm:
            _add_outer(verdict, vllm_embedding(embedding.scheme), embedding.name, "embedding")
    return verdicts


def _add_outer(verdict: EngineVerdict, support: Support, key: str, what: str) -> None:
    """A verdict on a part that is no Linear layer (the KV cache, the embedding) added to the engine's."""
    if support.loads:
        verdict.summary += f"; {what}: {support.kernel}"
    else:
        verdict.loads = False
        verdict.summary += f"; {what} refused ({support.reason})"
    verdict.layers[key] = support.label


def _verdict(engine: str, judge: Callable[[LayerShape], Support], layers: list[LayerShape]) -> EngineVerdict:
    verdicts = {layer.name: judge(layer) for layer in layers}
    loaded = Counter(v.kernel for v in verdicts.values() if v.loads)
    refused = Counter(v.reason for v in verdicts.values() if not v.loads)
    parts = [f"{kernel} {count}" for kernel, count in loaded.most_common()]
    parts += [f"refused {count} ({reason})" for reason, count in refused.most_common()]
    summary = ", ".join(parts)
    if engine == "transformers" and loaded:
        summary += f"; {TRANSFORMERS_RANGE}"
        if any(not layer.scheme.symmetric for layer in layers) or len({layer.scheme for layer in layers}) > 1:
            summary += "".join(f"; {version} {why}" for version, why in TRANSFORMERS_BROKEN.items())
    return EngineVerdict(engine, not refused, summary, {name: v.label for name, v in verdicts.items()})
