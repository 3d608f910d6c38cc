"""Llama-family decoder for the runtime, loaded straight from safetensors.

Which model types it runs and how they differ (q/k/v bias, q/k norm, sliding window by default, a sparse
mixture-of-experts MLP, q/k/v and gate/up stored as one fused linear each) is read from the architecture table,
:mod:`quantkit.model.architectures`: every family there is a Llama-shaped decoder, whose MLP is dense or (Qwen3-MoE,
Mixtral, Qwen2-MoE) a :class:`SparseMoE`; a family whose ``qkv`` (``gate_up``) stage is one linear (Phi-3's
``qkv_proj``, ``gate_up_proj``) stores that projection fused, and the runtime loads it as it is. Sliding windows and
Gemma 3's differences (layer types with their own rotary base, ``(1 + weight)`` RMSNorms, sandwich norms, a scaled
embedding, GeGLU, soft-capping) are read by :mod:`quantkit.runtime.family_config`. Qwen3.5's hybrid layers are gated
DeltaNet (:mod:`quantkit.runtime.deltanet`) or full attention with a sigmoid output gate.

The module tree mirrors Hugging Face's names (``model.layers.N.self_attn.q_proj`` ...) so checkpoint keys load as
they are: the model is built on the meta device from config.json, every Linear the quantization_config targets
becomes the buffers its format stores, then all shards are loaded with ``assign=True`` and the model is ``prepare``-d
for its backend. Tied embeddings share the embedding matrix with the LM head. A checkpoint with a ``kv_cache_scheme``
also loads every attention's ``k_scale`` / ``v_scale``: its KV cache is FP8 under them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.format.files import read_checkpoint_config, scale_dtypes, shard_files
from quantkit.format.loader import keeps_stored_dtype
from quantkit.format.quant_embedding import densify_embeddings
from quantkit.format.quantization_config import QuantizationLayout, parse_quantization_config
from quantkit.format.tensors import SCALE
from quantkit.model.architectures import GATE_UP, QKV, arch_for_model_type
from quantkit.model.gpt_oss import is_mxfp4, per_expert_state
from quantkit.runtime.attention_backend import AttentionMetadata
from quantkit.runtime.deltanet import DeltaNetConfig, GatedDeltaNet
from quantkit.runtime.family_config import FamilyFacts, LayerAttention, layer_attention, with_class_defaults
from quantkit.runtime.kv_stored_scales import register_kv_scale_buffers
from quantkit.runtime.layers import MLP, Attention, Linear, RMSNorm, RopeConfig, RotaryEmbedding, rms_norm
from quantkit.runtime.moe import MoEConfig, SparseMoE, with_config_defaults


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    sliding_window: int | None = None
    moe: MoEConfig | None = None  # a sparse MLP in every layer (None: dense)
    fused_qkv: bool = False  # the checkpoint stores q/k/v as one linear, self_attn.qkv_proj (Phi-3)
    fused_gate_up: bool = False  # the checkpoint stores gate/up as one linear, mlp.gate_up_proj (Phi-3)
    attention: LayerAttention | None = None  # each layer's window and rotary parameters (None: all full, ``rope``)
    attn_sinks: bool = False  # a learned per-head logit in every attention softmax (gpt_oss)
    linear_attention: DeltaNetConfig | None = None  # a hybrid's gated DeltaNet layers (Qwen3.5)
    # Gemma's norms, scales, activation and soft-capping (default: Llama's)
    family: FamilyFacts = field(default_factory=FamilyFacts)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to every key)."""
        return None if self.attention is None else self.attention.window_of(layer)

    @property
    def window_unimplemented(self) -> bool:
        """config.json sets a window the runtime does not apply (Qwen's use_sliding_window)."""
        return self.sliding_window is not None and (self.attention is None or self.attention.types is None)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        model_type = str(cfg.get("model_type") or "<missing model_type>")
        arch = arch_for_model_type(model_type)  # raises UnsupportedArchitectureError naming the supported ones
        moe = None
        if arch.moe is not None:
            cfg = with_config_defaults(model_type, cfg, arch.moe)
            moe = MoEConfig.from_hf(arch.for_config(cfg), cfg)  # for_config refuses dense/sparse mixes
        if arch.layer_types:
            cfg = with_class_defaults(model_type, cfg)  # Gemma 3's config.json omits keys equal to its defaults
        heads = int(cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias", False))
        attention = layer_attention(arch, cfg, int(cfg["num_hidden_layers"]))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size") or 0),  # Qwen3.5-MoE has none: every MLP is sparse
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch.qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch.qk_norm,
            rope=attention.rope,
            sliding_window=attention.window,
            moe=moe,
            # a stage of one linear: the checkpoint stores that projection fused (the table names it)
            fused_qkv=len(arch.stage(QKV).linears) == 1,
            fused_gate_up=moe is None and len(arch.stage(GATE_UP).linears) == 1,
            attention=attention,
            attn_sinks=arch.attention_sinks,
            linear_attention=DeltaNetConfig.from_hf(cfg) if arch.mixers else None,
            family=FamilyFacts.from_hf(arch, cfg),
        )


class DecoderLayer(nn.Module):
    """One block; residual adds are fused into the next RMSNorm (``norm(x, residual)``). With sandwich norms (Gemma)
    each sub-block's output is normalised before its residual add, and the MLP reads ``pre_feedforward_layernorm``."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        family, eps = cfg.family, cfg.rms_norm_eps
        self.local_rope = cfg.attention is not None and cfg.attention.local(index)  # Gemma 3's sliding layers
        deltanet = cfg.linear_attention if cfg.linear_attention and cfg.linear_attention.is_linear(index) else None
        self.mixer = "self_attn" if deltanet is None else "linear_attn"  # the token mixer, under its checkpoint name
        if deltanet is not None:  # a layer holds one token mixer or the other
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, deltanet)
        else:
            self.self_attn = Attention(
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                qkv_bias=cfg.qkv_bias,
                o_bias=cfg.o_bias,
                qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
                fused_qkv=cfg.fused_qkv,
                scale=family.attn_scale,
                window=cfg.window(index),
                softcap=family.attn_softcap,
                norm_offset=family.norm_offset,
                sinks=cfg.attn_sinks,
                output_gate=cfg.linear_attention is not None,  # Qwen3.5, the one hybrid family, gates it
            )
        # the MLP sits under the checkpoint's name for it ("mlp"; Mixtral's sparse one: "block_sparse_moe")
        self.mlp_path = "mlp" if cfg.moe is None else cfg.moe.path
        mlp: nn.Module
        if cfg.moe is None:
            fused, activation = cfg.fused_gate_up, family.activation
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, fused=fused, activation=activation)
        else:
            mlp = SparseMoE(cfg.hidden_size, cfg.moe)
        self.add_module(self.mlp_path, mlp)
        self.input_layernorm = rms_norm(cfg.hidden_size, eps, family.norm_offset)
        self.post_attention_layernorm = rms_norm(cfg.hidden_size, eps, family.norm_offset)
        self.sandwich = family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = rms_norm(cfg.hidden_size, eps, family.norm_offset)
            self.post_feedforward_layernorm = rms_norm(cfg.hidden_size, eps, family.norm_offset)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = getattr(self, self.mixer)(rope, x, meta)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(getattr(self, self.mlp_path)(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.mlp_path)(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        local = cfg.attention.local_rope if cfg.attention is not None else None
        self.rotary_local = RotaryEmbedding(cfg.head_dim, local) if local is not None else None  # Gemma 3
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_scale: torch.Tensor | None = None  # set by CausalLM.prepare where the family scales embeddings
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family.norm_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self.rotary(positions, x.dtype)
        local = self.rotary_local(positions, x.dtype) if self.rotary_local is not None else rope
        for layer in self.layers:
            x, residual = layer(local if layer.local_rope else rope, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    """Decoder + LM head. ``forward`` gives hidden states ``[T, H]``; ``compute_logits`` the fp32 logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = torch.nn.functional.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        cap = self.config.family.final_softcap
        if cap is not None:  # in the compute dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def prepare(self, dtype: torch.dtype, use_kernels: bool, max_positions: int) -> None:
        """After loading: cast, dequantize or keep packed, fuse dense projections (an MoE's experts' gate/up too),
        build the rotary table."""
        device = self.model.embed_tokens.weight.device
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(dtype, use_kernels)
            elif isinstance(module, RMSNorm):
                module.weight = nn.Parameter(module.weight.to(dtype), requires_grad=False)
                module.use_kernel = use_kernels and module.weight.is_cuda
        for module in self.modules():
            if isinstance(module, (Attention, MLP, GatedDeltaNet)):  # an MoE's shared expert is an MLP
                module.prepare()
            elif isinstance(module, SparseMoE):
                module.prepare(dtype)  # router in the compute dtype, each expert's gate/up fused
        self.model.embed_tokens.weight = nn.Parameter(self.model.embed_tokens.weight.to(dtype), requires_grad=False)
        self.model.rotary.build(max_positions, device)
        if self.model.rotary_local is not None:
            self.model.rotary_local.build(max_positions, device)
        scale = self.config.family.embed_scale
        if scale is not None:  # a float32 scalar cast to the weights' dtype, as transformers' scaled embedding
            self.model.embed_scale = torch.tensor(scale, dtype=torch.float32).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------- loading


def _apply_layout(model: CausalLM, layout: QuantizationLayout, scale_dtypes: Mapping[str, torch.dtype]) -> int:
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            scheme = layout.scheme_for(name, [c.__name__ for c in type(module).__mro__])
            if scheme is not None:
                module.quantize(scheme, scale_dtypes.get(f"{name}.{SCALE}", torch.bfloat16))
                count += 1
    return count


def _load_state(files: list[Path], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """All checkpoint tensors on ``device``; float tensors cast to ``dtype`` except codes and quantization scales
    (read as the format loader reads them)."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as handle:
            for key in handle.keys():  # noqa: SIM118
                tensor = handle.get_tensor(key)
                if not keeps_stored_dtype(key, tensor):
                    tensor = tensor.to(dtype)
                state[key] = tensor
    return state


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    use_kernels: bool = False,
    max_positions: int | None = None,
) -> CausalLM:
    """Build and load a :class:`CausalLM` from a HF or quantized (compressed-tensors) checkpoint directory."""
    path, device = Path(path), torch.device(device)
    raw = read_checkpoint_config(path)
    cfg = ModelConfig.from_hf(raw)
    files = shard_files(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    # the hub's gpt-oss: MXFP4 experts decoded to float when loaded (per_expert_state), every other tensor float
    quantized = raw.get("quantization_config") and not is_mxfp4(raw)
    layout = parse_quantization_config(raw["quantization_config"]) if quantized else None
    if layout is not None and _apply_layout(model, layout, scale_dtypes(files)) == 0:
        raise QuantkitError(f"quantization_config of {path} targets no Linear layer of the model")

    state = per_expert_state(_load_state(files, dtype, device))  # gpt_oss's files hold fused experts
    if layout is not None:
        densify_embeddings(model, layout, state)
    if layout is not None and layout.kv_cache is not None:  # the cache runs in FP8 under these (model_runner)
        attentions = [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]
        register_kv_scale_buffers(attentions, state, cfg.num_kv_heads)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding matrix is the head
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise QuantkitError(
            f"checkpoint {path} does not match its config.json: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}; the checkpoint is incomplete or of another architecture"
        )
    model.load_state_dict(state, strict=True, assign=True)
    model.prepare(dtype, use_kernels, max_positions or cfg.max_position_embeddings)
    return model.eval()


def read_generation_eos(path: str | Path) -> list[int]:
    """EOS ids as ``generate`` uses them: generation_config.json first, then config.json."""
    path = Path(path)
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else [int(e) for e in eos]
    return []
