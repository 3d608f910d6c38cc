"""What config.json says beyond a Llama-shaped decoder, read as transformers reads it: which layers attend through a
sliding window, and Gemma's facts (layer types with their own rotary parameters, the embedding scale, the attention
scale from ``query_pre_attn_scalar``, tanh soft-capping of the final logits and, where the family applies it, of the
attention scores, the MLP activation).

Windows follow transformers' rule (the query at position i sees keys i - window < j <= i). Mistral, Phi-3 and
Mixtral window every layer when config.json's ``sliding_window`` applies (``ArchSpec.sliding_window_by_default``);
Gemma 3 windows its ``sliding_attention`` layers (``ArchSpec.layer_types``), which also take
``rope_parameters["sliding_attention"]`` (a local base, 10k) while ``full_attention`` layers take
``rope_parameters["full_attention"]`` (1M, linear scaling on the larger models). Qwen's opt-in window
(``use_sliding_window``: transformers windows only the layers from ``max_window_layers`` on) is not implemented:
its layers get no window and the engine keeps such a model within the window (:attr:`LayerAttention.types` None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quantkit.errors import UnsupportedArchitectureError
from quantkit.model.architectures import ArchSpec
from quantkit.runtime.layers import ACTIVATIONS, RopeConfig

SLIDING, FULL = "sliding_attention", "full_attention"
# the keys Gemma's runtime reads, taken from transformers' config class when config.json omits them or spells them
# the older way (rope_theta / rope_local_base_freq / rope_scaling, sliding_window_pattern)
_CLASS_KEYS = (
    "layer_types",
    "rope_parameters",
    "sliding_window",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "hidden_activation",
    "tie_word_embeddings",
    "rms_norm_eps",
    "head_dim",
    "num_key_value_heads",
    "max_position_embeddings",
    "attention_bias",
    "use_bidirectional_attention",
)


def with_class_defaults(model_type: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with the keys above as transformers' config class for ``model_type`` reads config.json (Gemma 3's
    config.json may omit ``tie_word_embeddings``, ``query_pre_attn_scalar`` ... where they equal the defaults)."""
    from transformers import AutoConfig  # lazily: only the families that need the config class's defaults

    parsed = type(AutoConfig.for_model(model_type)).from_dict(dict(cfg))
    return {**cfg, **{key: getattr(parsed, key) for key in _CLASS_KEYS if hasattr(parsed, key)}}


@dataclass(slots=True, frozen=True)
class LayerAttention:
    """Each layer's attention: its kind (``sliding_attention`` or ``full_attention``; ``types`` None where the
    config's window is not implemented) and the rotary parameters of each kind."""

    types: tuple[str, ...] | None
    window: int | None  # of the sliding layers
    rope: RopeConfig  # of the full-attention layers (every layer but Gemma 3's sliding ones)
    local_rope: RopeConfig | None = None  # of the sliding layers, where they have their own (Gemma 3)

    def window_of(self, layer: int) -> int | None:
        return self.window if self.types is not None and self.types[layer] == SLIDING else None

    def local(self, layer: int) -> bool:
        """Whether ``layer`` rotates with :attr:`local_rope`."""
        return self.local_rope is not None and self.types is not None and self.types[layer] == SLIDING


def layer_attention(arch: ArchSpec, cfg: Mapping[str, Any], num_layers: int) -> LayerAttention:
    if not arch.layer_types:
        on = cfg.get("use_sliding_window", arch.sliding_window_by_default)
        window = int(cfg["sliding_window"]) if on and cfg.get("sliding_window") else None
        rope = RopeConfig.from_hf(cfg, partial_rotary=arch.partial_rotary)  # the others rotate whole heads
        types = (SLIDING if window else FULL,) * num_layers
        return LayerAttention(types if window is None or arch.sliding_window_by_default else None, window, rope)
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError(
            f"{cfg.get('model_type')}: use_bidirectional_attention (an embedding model's encoder) is not supported by "
            "the runtime, which serves causal language models"
        )
    types = tuple(str(t) for t in cfg["layer_types"])
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise UnsupportedArchitectureError(
            f"config.json layer_types {sorted(set(types))} ({len(types)} for {num_layers} layers) is not supported: "
            f"one of {SLIDING!r} or {FULL!r} per layer"
        )
    params = cfg["rope_parameters"]
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    if not (set(params) & {SLIDING, FULL}):  # one set of rotary parameters for every layer (gpt_oss)
        return LayerAttention(types, window, RopeConfig.from_hf(cfg))
    ropes = {
        kind: RopeConfig.from_hf({**cfg, "rope_scaling": None, "rope_parameters": params[kind]}) for kind in params
    }
    return LayerAttention(types, window, ropes[FULL], ropes[SLIDING])


@dataclass(slots=True, frozen=True)
class FamilyFacts:
    """The rest of what differs from Llama (defaults: Llama's)."""

    activation: str = "silu"
    norm_offset: float = 0.0  # RMSNorms multiply by (norm_offset + weight), in float32 (Gemma: 1)
    sandwich_norms: bool = False  # Gemma: post_attention/post_feedforward norms on each sub-block's output
    embed_scale: float | None = None  # token embeddings times this, cast to their dtype (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    # attention scores capped at softcap * tanh(scores / softcap), where the family applies it (attn_softcapping)
    attn_softcap: float | None = None
    final_softcap: float | None = None  # the same on the final logits (Gemma 2 and 3 when config.json sets it)

    @classmethod
    def from_hf(cls, arch: ArchSpec, cfg: Mapping[str, Any]) -> FamilyFacts:
        activation = str(cfg.get(arch.activation_key) or "silu")
        supported = ("silu",) if arch.moe is not None else tuple(ACTIVATIONS)  # the experts run SwiGLU
        if activation not in supported:
            raise UnsupportedArchitectureError(
                f"{arch.activation_key} {activation!r} is not supported (supported: {', '.join(supported)})"
            )
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            activation=activation,
            norm_offset=arch.norm_offset,
            sandwich_norms=arch.sandwich_norms is not None,
            embed_scale=float(cfg["hidden_size"]) ** 0.5 if arch.embed_scale else None,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=_positive(cfg, "attn_logit_softcapping") if arch.attn_softcapping else None,
            final_softcap=_positive(cfg, "final_logit_softcapping"),
        )


def _positive(cfg: Mapping[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    return float(value) if value else None
