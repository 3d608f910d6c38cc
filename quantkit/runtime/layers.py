"""Building blocks of the runtime's decoder: RMSNorm, rotary embedding, MLP, attention (the Linear they are made of
lives in :mod:`quantkit.runtime.linear`).

Tokens are flattened across sequences: activations are ``[T, hidden]`` with one row per scheduled token, and
attention splits them back per sequence through :class:`~quantkit.runtime.attention_backend.AttentionMetadata`.
Modules are built on the meta device, filled by ``load_state_dict(assign=True)`` with checkpoint tensors, then
``prepare``-d once for the chosen backend (dequantize or keep packed; fuse q/k/v and gate/up when dense and their
inputs are quantized alike; a checkpoint that stores them fused, as Phi-3's does, is used as it is).
Rounding points follow Hugging Face's eager Llama so that fp32 greedy decoding matches ``generate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.runtime.linear import FusedLinear, Linear, fuse_linears
from quantkit.runtime.yarn import yarn_attention_factor, yarn_inv_freq

if TYPE_CHECKING:
    from quantkit.runtime.attention_backend import AttentionBackend, AttentionMetadata
    from quantkit.runtime.kv_cache import LayerKV

# ----------------------------------------------------------------------------------------------- RMSNorm


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, optionally fused with the residual add that precedes it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.use_kernel = False  # Triton fused kernel (set by prepare on CUDA)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if self.use_kernel:
            from quantkit.runtime.kernels.rmsnorm import rmsnorm

            out, res = rmsnorm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, res)
        if residual is not None:
            x = residual + x
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (offset + weight)`` with the weight stored around zero, computed in float32
    and cast once at the end (transformers' Gemma3RMSNorm; Llama's casts before the multiply). Runs in torch always:
    the fused Triton kernel computes Llama's rounding."""

    def __init__(self, size: int, eps: float, offset: float) -> None:
        super().__init__(size, eps)
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is not None:
            x = residual + x
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (self.offset + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


def rms_norm(size: int, eps: float, offset: float = 0.0) -> RMSNorm:
    """Llama's RMSNorm, or Gemma's ``(offset + weight)`` one when the family stores its weights around zero."""
    return RMSNorm(size, eps) if offset == 0.0 else OffsetRMSNorm(size, eps, offset)


# ----------------------------------------------------------------------------------------------- rotary


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that is rotated (Phi-4-mini: 0.75)
    beta_fast: float = 32.0  # yarn: the correction range's bounds, in rotations
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the correction range rounded to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin multiplied by it (transformers' attention_scaling)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], *, partial_rotary: bool = False) -> RopeConfig:
        """Read ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older configs).
        ``partial_rotary``: the model rotates only the first ``partial_rotary_factor`` of each head (Phi-3), as
        transformers' Phi-3 does; elsewhere a factor below 1 is refused."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        type_key = "rope_type" if "rope_type" in params else "type"
        rope_type = str(params.get(type_key, "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            section = "rope_parameters" if type_key in (cfg.get("rope_parameters") or {}) else "rope_scaling"
            raise QuantkitError(
                f"config.json {section}.{type_key} {rope_type!r} is not supported by the runtime "
                "(supported: default, linear, llama3, yarn)"
            )
        # transformers moves a top-level partial_rotary_factor (Phi-4-mini's config.json) into rope_parameters
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        partial = 1.0 if partial is None else float(partial)
        if partial != 1.0 and not (partial_rotary and 0.0 < partial < 1.0):
            allowed = "0 < partial_rotary_factor <= 1" if partial_rotary else "1.0 only: it rotates whole heads"
            raise QuantkitError(
                f"config.json partial_rotary_factor {partial} is not supported by the runtime for model type "
                f"{cfg.get('model_type')!r} ({allowed})"
            )
        if rope_type == "default":
            return cls(theta=theta, partial_rotary_factor=partial)
        if rope_type == "yarn":
            return cls(
                theta=theta,
                rope_type=rope_type,
                factor=float(params["factor"]),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
                ),
                partial_rotary_factor=partial,
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                truncate=bool(params.get("truncate", True)),
                attention_factor=yarn_attention_factor(params),
            )
        return cls(
            theta=theta,
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
            ),
            partial_rotary_factor=partial,
        )

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's leading dimensions are rotated (all of them unless partial)."""
        return int(head_dim * self.partial_rotary_factor)

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """The rotated dimensions' inverse frequencies, ``[rotary_dim(head_dim) // 2]``."""
        dim = self.rotary_dim(head_dim)
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        if self.rope_type == "yarn":
            return yarn_inv_freq(self, dim, inv)
        return inv


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a precomputed fp32 cos/sin table (built by ``build``, not loaded)."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, max_positions: int, device: torch.device | str) -> None:
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * self.rope.inv_freq(self.head_dim)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rotary_dim], as HF computes it
        scale = self.rope.attention_factor  # yarn's, 1 for the others (then no multiply: the tables stay bit-equal)
        cos, sin = (emb.cos(), emb.sin()) if scale == 1.0 else (emb.cos() * scale, emb.sin() * scale)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, R]`` (R: the rotary dimensions) at ``positions [T]``, looked up once per step and
        shared by all layers."""
        assert self.cos is not None and self.sin is not None, "call build() before running the model"
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, self.sin.index_select(0, positions).to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the ``(cos, sin)`` of its positions (as HF ``apply_rotary_pos_emb``); with partial
    rotary (a table narrower than D) only the leading dimensions, the rest pass through (as HF's Phi-3)."""
    cos, sin = rope
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ----------------------------------------------------------------------------------------------- MLP


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}  # transformers' ACT2FN


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, SwiGLU (``activation`` silu) or GeGLU (Gemma's gelu_pytorch_tanh).
    ``fused``: the checkpoint stores gate and up as one linear, ``gate_up_proj`` (Phi-3: the gate rows, then the up
    rows), used as it is; otherwise ``gate_proj`` and ``up_proj``, fused into one matmul by ``prepare`` when they
    can be."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool = False, *, fused: bool = False, activation: str = "silu"
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias) if fused else None
        self.gate_proj = None if fused else Linear(hidden, intermediate, bias)
        self.up_proj = None if fused else Linear(hidden, intermediate, bias)
        self.down_proj = Linear(intermediate, hidden, bias)
        self.gate_up: FusedLinear | None = None  # gate and up as one matmul, set by prepare

    def prepare(self) -> None:
        if self.gate_proj is not None and self.up_proj is not None:
            self.gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        elif self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


# ----------------------------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache (q/k norm for Qwen3, q/k/v bias for Qwen2).

    ``scale`` defaults to ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar ** -0.5``); ``window``: a sliding
    window, the query at position i sees keys i - window < j <= i; ``softcap``: scores soft-capped as
    ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2's attn_logit_softcapping); ``norm_offset``: the q/k
    norms multiply by ``(norm_offset + weight)`` (Gemma); ``sinks``: a learned per-head logit joins each softmax
    (gpt_oss's attention sinks).

    ``fused_qkv``: the checkpoint stores q, k and v as one linear, ``qkv_proj`` (Phi-3: the q rows, then k, then v),
    used as it is; otherwise ``q_proj``, ``k_proj`` and ``v_proj``, fused into one matmul by ``prepare`` when they
    can be."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        fused_qkv: bool = False,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        norm_offset: float = 0.0,
        sinks: bool = False,
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate  # Qwen3.5: q_proj's rows per head are its query, then a sigmoid output gate
        # gpt_oss: a learned logit per query head that joins each row's softmax and takes its share of the weight
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        q_size, kv_size = num_heads * head_dim * (2 if output_gate else 1), num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, q_size + 2 * kv_size, qkv_bias) if fused_qkv else None
        self.q_proj = None if fused_qkv else Linear(hidden, q_size, qkv_bias)
        self.k_proj = None if fused_qkv else Linear(hidden, kv_size, qkv_bias)
        self.v_proj = None if fused_qkv else Linear(hidden, kv_size, qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, o_bias)
        self.q_norm = rms_norm(head_dim, qk_norm_eps, norm_offset) if qk_norm_eps is not None else None
        self.k_norm = rms_norm(head_dim, qk_norm_eps, norm_offset) if qk_norm_eps is not None else None
        self.qkv: FusedLinear | None = None  # q, k and v as one matmul, set by prepare
        self.backend: AttentionBackend | None = None  # set by the model runner
        self.kv: LayerKV | None = None  # this layer's paged cache, set by the model runner

    def prepare(self) -> None:
        if self.q_proj is not None and self.k_proj is not None and self.v_proj is not None:
            self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_out = 2 * q_size if self.output_gate else q_size
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([q_out, kv_size, kv_size], dim=-1)
        elif self.qkv is not None:
            q, k, v = self.qkv(x).split([q_out, kv_size, kv_size], dim=-1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.reshape(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        assert self.backend is not None and self.kv is not None
        out = self.backend.forward(
            q, k, v.contiguous(), self.kv, meta, self.scale, window=self.window, softcap=self.softcap, sinks=self.sinks
        )
        out = out.reshape(t, q_size)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate.reshape(t, q_size)))
