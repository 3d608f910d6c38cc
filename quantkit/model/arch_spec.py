"""The vocabulary architectures are described in: stages of a decoder block, AWQ scaling groups, mixture-of-experts
blocks, per-layer mixers and the :class:`ArchSpec` that holds them (the table of families is in
:mod:`quantkit.model.architectures`).

Module paths are relative to a decoder layer unless named otherwise. ``stages`` gives the order in which a
block's linears are solved (true sequential), each stage by name: ``qkv``, then ``o``, then ``gate_up``, then
``down``; linears inside one stage share their input and form a fused group that runtimes such as vLLM load as
one matrix, so they must share a quantization scheme.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

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
# a mixture-of-experts block's down_proj stages, one per expert (each reads its own expert's activations):
# "down.shared" for the shared expert, "down.<e>" for routed expert e; with routed calibration, "gate_up.<e>"
EXPERT_STAGE_SEPARATOR = "."


@dataclass(slots=True, frozen=True)
class MoESpec:
    """A sparse MLP: a router (kept in float) sends each token to its top-k routed experts; an optional shared
    expert (a dense MLP, with an optional sigmoid gate) runs on every token. Paths are relative to the MoE module,
    whose own path (``ArchSpec.mlp_path``) is the one checkpoints store, per expert, as llm-compressor, vLLM and
    transformers' ``save_pretrained`` name them (``experts.<e>.<gate|up|down>``); transformers 5 fuses the experts
    into 3-D parameters in memory, quantkit unfuses them (:mod:`quantkit.model.moe`)."""

    router: str = "gate"
    experts: str = "experts"
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down (Mixtral: w1/w3/w2)
    shared_expert: str | None = None  # Qwen2-MoE: "shared_expert"
    shared_expert_gate: str | None = None  # Qwen2-MoE: "shared_expert_gate", a [1, H] linear kept in float
    hf_path: str = "mlp"  # where transformers' decoder layer holds the MoE module (Mixtral stores it elsewhere)
    # transformers 5 maps num_experts onto num_local_experts (its attribute map), hub configs may hold either
    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    top_k_key: str = "num_experts_per_tok"
    expert_size_key: str = "moe_intermediate_size"  # config.json key of a routed expert's intermediate size
    # whether the top-k routing weights are renormalised to sum to one: a config.json key (Qwen's norm_topk_prob),
    # or None where the family's router always renormalises (Mixtral)
    renormalize_key: str | None = "norm_topk_prob"
    float_routing_weights: bool = False  # Mixtral's router keeps the weights in fp32 to scale expert outputs
    # how transformers fuses the experts: "stacked" (gate_up_proj [E, 2I, H], gate rows then up rows) or "interleaved"
    # (gpt_oss: [E, H, 2I] with gate/up in even/odd columns, biases; :mod:`quantkit.model.gpt_oss`)
    fused_layout: str = "stacked"
    expert_bias: bool = False  # each expert's gate/up/down carry a bias (gpt_oss)
    # "glu": act(gate) * up; "clamped_swiglu": gpt_oss's (up + 1) * gate * sigmoid(alpha * gate), both clamped
    expert_activation: str = "glu"
    returns_router_scores: bool = False  # the decoder layer unpacks (hidden, router scores) from its MLP (gpt_oss)
    # the router (a linear with a bias) takes the top-k logits, then softmaxes them among themselves (gpt_oss); the
    # others softmax over every expert, then take the top k
    topk_then_softmax: bool = False


@dataclass(slots=True, frozen=True)
class Mixer:
    """A hybrid model's token mixer for the layers whose config.json ``layer_types`` entry is ``layer_type``: where it
    sits in the layer, its ``qkv`` and ``o`` stages (the layer's attention stages), the AWQ groups that replace the
    spec's first two, linears kept in float and norms inside it (:meth:`ArchSpec.for_layer`)."""

    layer_type: str
    attn_path: str
    stages: tuple[Stage, Stage]
    awq_groups: tuple[ScalingGroup, ...]
    float_linears: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()


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
    norm_offset: float = 0.0  # RMSNorms multiply by (norm_offset + weight): Gemma stores weights around zero
    partial_rotary: bool = False  # config's partial_rotary_factor may rotate part of each head (Phi-3, Phi-4-mini)
    # Gemma's sandwich norms: (after attention, after the MLP), each applied to its sub-block's output before the
    # residual add; norms[1] is then the pre-MLP norm (the one the MLP's linears read)
    sandwich_norms: tuple[str, str] | None = None
    # the token mixers multiply their output elementwise by a learned gate before the output projection (Qwen3.5's
    # full attention: sigmoid(gate) * attention; its DeltaNet: a gated per-head norm before out_proj): a rotation of
    # each head between the value and output projections does not commute with it
    gated_attention_output: bool = False
    sliding_window_by_default: bool = False  # config.json's sliding_window applies unless use_sliding_window is false
    # config.json's layer_types pick each layer's attention (Gemma 3): "sliding_attention" layers attend to the last
    # sliding_window keys under rope_parameters["sliding_attention"], "full_attention" layers to every key under
    # rope_parameters["full_attention"] (omitted keys take transformers' config-class defaults)
    layer_types: bool = False
    # the decoder's attention reads the mask it is given, without one it attends both ways (gpt_oss's eager attention
    # with sinks; the others fall back to causal SDPA): calibration then passes a causal mask to every layer
    explicit_causal_mask: bool = False
    attention_sinks: bool = False  # a learned per-head logit in every softmax (gpt_oss's self_attn.sinks)
    embed_scale: bool = False  # token embeddings multiplied by sqrt(hidden_size), in the weights' dtype (Gemma)
    activation_key: str = "hidden_act"  # config.json key of the MLP's activation (Gemma: hidden_activation)
    # config.json's attn_logit_softcapping caps attention scores (Gemma 2); transformers' Gemma 3 reads the key but
    # never applies it (its final_logit_softcapping it does apply: every family's, when set)
    attn_softcapping: bool = False
    gguf_arch: str | None = "llama"  # llama.cpp's name (gguf.MODEL_ARCH member, lower case); None: no GGUF export
    moe: MoESpec | None = None  # a sparse MLP (stages and groups expanded per expert by :meth:`for_config`)
    num_experts: int = 0  # set by :meth:`for_config` for an MoE family
    float_linears: tuple[str, ...] = ()  # linears never quantized (the router): written in float, listed as ignored
    # a hybrid model's token mixers by layer type (Qwen3.5: gated DeltaNet and gated full attention); the spec's own
    # stages are its full-attention layers', :meth:`for_layer` gives each layer's (``layer_kinds``: set by for_config)
    mixers: tuple[Mixer, ...] = ()
    layer_kinds: tuple[str, ...] = ()
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
        """Linears that must share one scheme: each dense stage's (engines load q/k/v and gate/up as one matrix);
        in an MoE block, the shared expert's gate/up and all routed experts of the layer together (vLLM's fused-MoE
        layer holds every expert's gate, up and down under one quantization method)."""
        if self.moe is None:
            return tuple(stage.linears for stage in self.stages if len(stage.linears) > 1)
        dense = tuple(stage.linears for stage in self.stages if len(stage.linears) > 1 and stage.name != GATE_UP)
        groups = [*dense, self.routed_expert_linears()]
        shared = self.shared_expert_linears()
        return (*groups, shared[:2]) if shared else tuple(groups)

    def routed_expert_linears(self, expert: int | None = None) -> tuple[str, ...]:
        """Every routed expert's gate, up and down (or one expert's), relative to a decoder layer."""
        assert self.moe is not None
        experts = range(self.num_experts) if expert is None else (expert,)
        base = f"{self.mlp_path}.{self.moe.experts}"
        return tuple(f"{base}.{e}.{leaf}" for e in experts for leaf in self.moe.expert_linears)

    def shared_expert_linears(self) -> tuple[str, ...]:
        """The shared expert's gate, up and down (empty without one)."""
        if self.moe is None or self.moe.shared_expert is None:
            return ()
        base = f"{self.mlp_path}.{self.moe.shared_expert}"
        return tuple(f"{base}.{leaf}" for leaf in ("gate_proj", "up_proj", "down_proj"))

    def for_config(self, config: Mapping[str, Any]) -> ArchSpec:
        """This family as the model ``config`` (config.json) builds it: an MoE family's stages, groups and float
        linears expanded per expert; a dense family as it is."""
        if self.moe is None:
            return self
        moe = self.moe
        sparse_step = int(config.get("decoder_sparse_step", 1) or 1)
        if config.get("mlp_only_layers") or sparse_step != 1:
            raise UnsupportedArchitectureError(
                f"{self.family}: models that mix dense and sparse MLP layers (mlp_only_layers, decoder_sparse_step "
                "!= 1) are not supported; quantkit quantizes models whose every layer is a mixture of experts"
            )
        experts = next((int(config[key]) for key in moe.num_experts_keys if config.get(key)), 0)
        if experts < 1:
            raise UnsupportedArchitectureError(f"{self.family}: config.json gives no {moe.num_experts_keys[0]}")
        spec = replace(self, num_experts=experts)
        gate, up, down = moe.expert_linears
        base = f"{self.mlp_path}.{moe.experts}"
        shared = spec.shared_expert_linears()
        gate_up = (*shared[:2], *(f"{base}.{e}.{leaf}" for e in range(experts) for leaf in (gate, up)))
        downs = ((Stage(f"{DOWN}.shared", shared[2:]),) if shared else ()) + tuple(
            Stage(f"{DOWN}.{e}", (f"{base}.{e}.{down}",)) for e in range(experts)
        )
        stages = (self.stage(QKV), self.stage(O_PROJ), Stage(GATE_UP, gate_up), *downs)
        floats = (f"{self.mlp_path}.{moe.router}",)
        if moe.shared_expert_gate is not None:
            floats += (f"{self.mlp_path}.{moe.shared_expert_gate}",)
        # up -> down scales fold through act(gate) * up only: gpt_oss's clamp and (up + 1) do not commute with them
        up_down = moe.expert_activation == "glu"
        awq = (
            *self.awq_groups[:2],  # q/k/v behind input_layernorm, o_proj behind v_proj
            # the router reads the same normalised input: its columns take the same scales (it stays in float)
            ScalingGroup(self.norms[1], (*gate_up, *floats)),
            *(ScalingGroup(f"{base}.{e}.{up}", (f"{base}.{e}.{down}",)) for e in range(experts) if up_down),
            *((ScalingGroup(shared[1], (shared[2],)),) if shared else ()),
        )
        kinds = tuple(str(t) for t in config.get("layer_types") or ()) if self.mixers else ()
        unknown = set(kinds) - {m.layer_type for m in self.mixers}
        if self.mixers and (len(kinds) != int(config.get("num_hidden_layers", -1)) or unknown):
            raise UnsupportedArchitectureError(
                f"{self.family}: config.json's layer_types do not name each layer's "
                f"mixer ({', '.join(m.layer_type for m in self.mixers)})"
            )
        return replace(spec, stages=stages, float_linears=floats, awq_groups=awq, layer_kinds=kinds)

    def for_layer(self, index: int) -> ArchSpec:
        """Layer ``index`` of this model: a hybrid model's layer with its own mixer's stages, AWQ groups, float
        linears and norms (call on the spec :meth:`for_config` made); any other family's layers are all alike."""
        if not self.mixers:
            return self
        kind = self.layer_kinds[index]
        mixer = next(m for m in self.mixers if m.layer_type == kind)
        return replace(
            self,
            attn_path=mixer.attn_path,
            stages=(*mixer.stages, *self.stages[2:]),
            awq_groups=(*mixer.awq_groups, *self.awq_groups[2:]),
            float_linears=(*mixer.float_linears, *self.float_linears),
            norms=(*self.norms[:2], *mixer.norms),
            mixers=(),
            layer_kinds=(),
        )

    def routed_stages(self) -> tuple[Stage, ...]:
        """The MoE stages for routed calibration: each expert's gate/up solved on the tokens routed to it (its own
        Hessian), the shared expert's on every token."""
        assert self.moe is not None
        shared = self.shared_expert_linears()
        gate, up, _ = self.moe.expert_linears
        base = f"{self.mlp_path}.{self.moe.experts}"
        per_expert = tuple(
            Stage(f"{GATE_UP}.{e}", (f"{base}.{e}.{gate}", f"{base}.{e}.{up}")) for e in range(self.num_experts)
        )
        head = (self.stage(QKV), self.stage(O_PROJ))
        shared_stage = (Stage(GATE_UP, shared[:2]),) if shared else ()
        downs = tuple(s for s in self.stages if s.name.startswith(f"{DOWN}."))
        return (*head, *shared_stage, *per_expert, *downs)

    def stage(self, name: str) -> Stage:
        return next(stage for stage in self.stages if stage.name == name)

    def stage_of(self, linear: str) -> Stage:
        """The stage a linear (path relative to a decoder layer) belongs to."""
        for stage in self.stages:
            if linear in stage.linears:
                return stage
        raise UnsupportedArchitectureError(f"linear {linear!r} is in no stage of the {self.family} architecture")
