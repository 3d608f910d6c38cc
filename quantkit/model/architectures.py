"""Supported architectures, described as data: one table entry per family, no subclass per model (the entries'
vocabulary, :class:`ArchSpec` and its parts, is in :mod:`quantkit.model.arch_spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantkit.errors import UnsupportedArchitectureError
from quantkit.model.arch_spec import (
    DOWN,
    EXPERT_STAGE_SEPARATOR,
    GATE_UP,
    O_PROJ,
    QKV,
    ArchSpec,
    Mixer,
    MoESpec,
    ScalingGroup,
    Stage,
)

__all__ = [
    "ARCHITECTURES",
    "DOWN",
    "EXPERT_STAGE_SEPARATOR",
    "GATE_UP",
    "O_PROJ",
    "QKV",
    "ArchSpec",
    "Mixer",
    "MoESpec",
    "ScalingGroup",
    "Stage",
    "arch_for_config",
    "arch_for_model_type",
    "supported_model_types",
]

_DELTANET_INPUTS = tuple(f"linear_attn.in_proj_{p}" for p in ("qkv", "z", "b", "a"))  # each reads the layer's input

ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec(family="llama", model_types=("llama",)),
    ArchSpec(family="mistral", model_types=("mistral",), sliding_window_by_default=True),
    ArchSpec(family="qwen2", model_types=("qwen2",), qkv_bias=True, gguf_arch="qwen2"),
    ArchSpec(
        family="qwen3",
        model_types=("qwen3",),
        norms=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
        qk_norm=True,
        gguf_arch="qwen3",
    ),
    ArchSpec(
        family="phi3",
        model_types=("phi3",),
        # fused projections, solved and stored fused: vLLM's Phi-3 loads qkv_proj and gate_up_proj as one matrix each
        stages=(
            Stage(QKV, ("self_attn.qkv_proj",)),
            Stage(O_PROJ, ("self_attn.o_proj",)),
            Stage(GATE_UP, ("mlp.gate_up_proj",)),
            Stage(DOWN, ("mlp.down_proj",)),
        ),
        # v_proj and up_proj are row blocks of the fused projections: their outputs cannot take AWQ scales alone
        awq_groups=(
            ScalingGroup("input_layernorm", ("self_attn.qkv_proj",)),
            ScalingGroup("post_attention_layernorm", ("mlp.gate_up_proj",)),
        ),
        sliding_window_by_default=True,
        partial_rotary=True,
        gguf_arch=None,
    ),
    ArchSpec(
        family="gemma3",
        model_types=("gemma3_text",),
        norms=(
            "input_layernorm",
            "pre_feedforward_layernorm",
            "post_attention_layernorm",
            "post_feedforward_layernorm",
            "self_attn.q_norm",
            "self_attn.k_norm",
        ),
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        layer_types=True,
        embed_scale=True,
        activation_key="hidden_activation",
        awq_groups=(
            ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),  # only when the shapes allow it (no GQA)
            ScalingGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
        ),
        gguf_arch=None,
    ),
    ArchSpec(
        family="qwen3_moe",
        model_types=("qwen3_moe",),
        norms=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
        qk_norm=True,
        gguf_arch=None,
        moe=MoESpec(),
    ),
    ArchSpec(
        family="mixtral",
        model_types=("mixtral",),
        mlp_path="block_sparse_moe",
        sliding_window_by_default=True,
        gguf_arch=None,
        moe=MoESpec(
            expert_linears=("w1", "w3", "w2"),
            expert_size_key="intermediate_size",
            renormalize_key=None,
            float_routing_weights=True,
        ),
    ),
    ArchSpec(
        family="qwen2_moe",
        model_types=("qwen2_moe",),
        qkv_bias=True,
        gguf_arch=None,
        moe=MoESpec(shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"),
    ),
    # Qwen3.5-MoE's text decoder (model type qwen3_5_moe_text; the multimodal qwen3_5_moe checkpoint is refused,
    # naming the fix: _TEXT_MODEL_OF): 3 of 4 layers gated DeltaNet, the others full attention whose q_proj also
    # emits a sigmoid output gate.
    # vLLM (layers/mamba/gdn_linear_attn.py, models/qwen3_5.py) loads in_proj_qkv + in_proj_z as one in_proj_qkvz and
    # in_proj_b + in_proj_a as one in_proj_ba, each fused pair under one scheme. quantkit quantizes qkv/z and out_proj
    # (as llm-compressor's Qwen3-Next AWQ example does) and keeps in_proj_b/in_proj_a in float: [heads, H] projections
    # feeding the decay and the write strength, like the router (vLLM: "ba_proj doesn't support blockwise fp8").
    # llm-compressor's Qwen3.5 examples keep every linear_attn linear in float: --ignore 'linear_attn\.' does that.
    ArchSpec(
        family="qwen3_5_moe",
        model_types=("qwen3_5_moe_text",),
        norms=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
        qk_norm=True,
        norm_offset=1.0,
        partial_rotary=True,
        gated_attention_output=True,
        gguf_arch=None,
        # its router always renormalises the top-k weights (transformers' Qwen3_5MoeTopKRouter; no norm_topk_prob key)
        moe=MoESpec(shared_expert="shared_expert", shared_expert_gate="shared_expert_gate", renormalize_key=None),
        mixers=(
            Mixer(
                "full_attention",
                "self_attn",
                (
                    Stage(QKV, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                    Stage(O_PROJ, ("self_attn.o_proj",)),
                ),
                (
                    ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                    ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),  # only without GQA
                ),
                norms=("self_attn.q_norm", "self_attn.k_norm"),
            ),
            Mixer(
                "linear_attention",
                "linear_attn",
                (
                    Stage(QKV, ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z")),
                    Stage(O_PROJ, ("linear_attn.out_proj",)),
                ),
                # out_proj reads a per-head gated RMSNorm of the delta rule's output: no scale folds into it
                (ScalingGroup("input_layernorm", _DELTANET_INPUTS),),
                float_linears=_DELTANET_INPUTS[2:],
            ),
        ),
    ),
    ArchSpec(
        family="gpt_oss",
        model_types=("gpt_oss",),
        qkv_bias=True,  # q/k/v and o_proj carry biases (config.json attention_bias, true for gpt-oss)
        layer_types=True,  # sliding_attention / full_attention layers, alternating
        explicit_causal_mask=True,  # eager attention with sinks: no mask means no causal mask
        attention_sinks=True,
        gguf_arch=None,
        moe=MoESpec(
            router="router",
            expert_size_key="intermediate_size",
            renormalize_key=None,  # softmax over the top-k logits: the weights sum to one
            fused_layout="interleaved",
            expert_bias=True,
            expert_activation="clamped_swiglu",
            returns_router_scores=True,
            topk_then_softmax=True,
        ),
    ),
)


# multimodal model types whose text decoder is supported under its own model type
_TEXT_MODEL_OF = {"qwen3_5_moe": "qwen3_5_moe_text"}


def supported_model_types() -> list[str]:
    return sorted(t for spec in ARCHITECTURES for t in spec.model_types)


def arch_for_config(config: Mapping[str, Any]) -> ArchSpec:
    """The architecture a config.json describes, expanded for it (an MoE family's experts)."""
    return arch_for_model_type(str(config.get("model_type", "<missing model_type>"))).for_config(config)


def arch_for_model_type(model_type: str) -> ArchSpec:
    for spec in ARCHITECTURES:
        if model_type in spec.model_types:
            return spec
    if model_type in _TEXT_MODEL_OF:  # transformers' AutoModelForCausalLM loads the text model alone, and saves it
        raise UnsupportedArchitectureError(
            f"'{model_type}' (a multimodal checkpoint, vision tower included) is not supported; quantkit quantizes "
            f"its text model, model type {_TEXT_MODEL_OF[model_type]}: save it with transformers' "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(text_dir) and quantize text_dir"
        )
    raise UnsupportedArchitectureError(
        f"architecture '{model_type}' is not supported; supported model types: {', '.join(supported_model_types())}"
    )
