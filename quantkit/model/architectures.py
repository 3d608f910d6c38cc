"""Supported architectures, described as data: one table entry per family, no subclass per model.

Module paths are relative to a decoder layer unless named otherwise. ``stages`` gives the order in which a
block's linears are solved (true sequential), each stage by name: ``qkv``, then ``o``, then ``gate_up``, then
``down``; linears inside one stage share their input and form a fused group that runtimes such as vLLM load as
one matrix, so they must share a quantization scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import UnsupportedArchitectureError


@dataclass(slots=True, frozen=True)
class ScalingGroup:
    """AWQ: ``prev``'s output scales are folded into ``linears``' input columns."""

    prev: str
    linears: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class Stage:
    """Linears that read the same input, solved together: ``qkv``, ``o``, ``gate_up`` or ``down``."""

    name: str
    linears: tuple[str, ...]

    @property
    def head(self) -> str:
        """The stage's first linear (its input is the stage's input)."""
        return self.linears[0]


QKV, O_PROJ, GATE_UP, DOWN = "qkv", "o", "gate_up", "down"  # stage names


@dataclass(slots=True, frozen=True)
class ArchSpec:
    family: str
    model_types: tuple[str, ...]
    layers_path: str = "model.layers"
    embed_path: str = "model.embed_tokens"
    final_norm_path: str = "model.norm"
    lm_head_path: str = "lm_head"
    rotary_path: str = "model.rotary_emb"
    attn_path: str = "self_attn"  # relative to a decoder layer; ends in o_proj
    mlp_path: str = "mlp"  # ends in down_proj
    stages: tuple[Stage, ...] = (
        Stage(QKV, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Stage(O_PROJ, ("self_attn.o_proj",)),
        Stage(GATE_UP, ("mlp.gate_proj", "mlp.up_proj")),
        Stage(DOWN, ("mlp.down_proj",)),
    )
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    qkv_bias: bool = False  # q/k/v always carry a bias (else only where config.json's attention_bias says so)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before RoPE (Qwen3)
    sliding_window_by_default: bool = False  # config.json's sliding_window applies unless use_sliding_window is false
    gguf_arch: str | None = "llama"  # llama.cpp's name (gguf.MODEL_ARCH member, lower case); None: no GGUF export
    awq_groups: tuple[ScalingGroup, ...] = (
        ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),  # only when the shapes allow it (no GQA)
        ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
    )

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for stage in self.stages for name in stage.linears)

    @property
    def fused_groups(self) -> tuple[tuple[str, ...], ...]:
        return tuple(stage.linears for stage in self.stages if len(stage.linears) > 1)

    def stage(self, name: str) -> Stage:
        return next(stage for stage in self.stages if stage.name == name)

    def stage_of(self, linear: str) -> Stage:
        """The stage a linear (path relative to a decoder layer) belongs to."""
        for stage in self.stages:
            if linear in stage.linears:
                return stage
        raise UnsupportedArchitectureError(f"linear {linear!r} is in no stage of the {self.family} architecture")


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
)


def supported_model_types() -> list[str]:
    return sorted(t for spec in ARCHITECTURES for t in spec.model_types)


def arch_for_model_type(model_type: str) -> ArchSpec:
    for spec in ARCHITECTURES:
        if model_type in spec.model_types:
            return spec
    raise UnsupportedArchitectureError(
        f"architecture '{model_type}' is not supported; supported model types: {', '.join(supported_model_types())}"
    )
