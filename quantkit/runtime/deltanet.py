"""Qwen3.5's gated DeltaNet token mixer (``linear_attention`` layers) for the runtime, over flattened tokens.

Per token: ``in_proj_qkv`` gives the mixed q/k/v channels, which pass a causal depthwise conv1d (with SiLU);
``in_proj_z`` the output gate, ``in_proj_b`` the write strength and ``in_proj_a`` (with ``A_log`` and ``dt_bias``)
the decay of the gated delta rule (:mod:`quantkit.runtime.gated_delta`); its output goes through an RMSNorm per value
head gated by ``silu(z)``, then ``out_proj``. Module names are the checkpoint's (``linear_attn.in_proj_qkv`` ...),
so a quantkit checkpoint, which quantizes ``in_proj_qkv`` and ``in_proj_z`` under one scheme (vLLM loads them fused as
``in_proj_qkvz``) and keeps ``in_proj_b`` / ``in_proj_a`` in float, loads by name; ``prepare`` fuses each pair into
one matmul where both are dense, as vLLM's ``in_proj_qkvz`` / ``in_proj_ba``.

Unlike attention, the layer keeps no per-token cache: each running sequence owns a state slot
(:mod:`quantkit.runtime.state_slots`) holding its conv state (the last ``kernel - 1`` conv inputs) and its delta-rule
state; ``AttentionMetadata.state_slots`` names each scheduled sequence's slot. A sequence whose step starts at
position 0 (a new prompt, or one preempted and recomputed) starts from zeros, whatever its slot held; a later prefill
chunk continues from its slot. Prefill runs the chunked form of the rule per sequence, decode the recurrent form for
the whole batch at once, as transformers does. Every backend runs these layers in torch (there is no Triton kernel
for them; the full-attention layers still use the backend's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.runtime.gated_delta import causal_conv, chunked_rule, decay_and_strength, recurrent_rule
from quantkit.runtime.layers import RMSNorm
from quantkit.runtime.linear import FusedLinear, Linear, fuse_linears

if TYPE_CHECKING:
    from quantkit.runtime.attention_backend import AttentionMetadata

LINEAR_ATTENTION = "linear_attention"  # config.json layer_types entry of a gated DeltaNet layer


@dataclass(slots=True, frozen=True)
class DeltaNetConfig:
    """Which layers are gated DeltaNet layers and their shapes (config.json's ``linear_*`` keys)."""

    layer_types: tuple[str, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    eps: float

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> DeltaNetConfig:
        return cls(
            layer_types=tuple(str(t) for t in cfg["layer_types"]),
            num_k_heads=int(cfg["linear_num_key_heads"]),
            num_v_heads=int(cfg["linear_num_value_heads"]),
            k_head_dim=int(cfg["linear_key_head_dim"]),
            v_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg["linear_conv_kernel_dim"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
        )

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the mixed q, k and v the conv runs over."""
        return 2 * self.key_dim + self.value_dim


@dataclass(slots=True, frozen=True)
class LayerState:
    """One layer's per-slot states: ``conv [slots, conv_dim, kernel - 1]`` in the compute dtype and ``recurrent
    [slots, Hv, Dk, Dv]`` in float32 (transformers' delta rule computes and returns it in float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class GatedRMSNorm(RMSNorm):
    """``weight * x / rms(x) * silu(z)`` per value head, rounded as transformers' Qwen3_5MoeRMSNormGated (its weight
    is stored around one: no offset)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        assert gate is not None
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class _Conv(nn.Module):
    """Holds the depthwise conv's weight under the checkpoint's name (``conv1d.weight [C, 1, K]``, no bias)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, cfg: DeltaNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_proj_qkv = Linear(hidden, cfg.conv_dim)
        self.in_proj_z = Linear(hidden, cfg.value_dim)
        self.in_proj_b = Linear(hidden, cfg.num_v_heads)
        self.in_proj_a = Linear(hidden, cfg.num_v_heads)
        self.conv1d = _Conv(cfg.conv_dim, cfg.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(cfg.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(cfg.v_head_dim, cfg.eps)
        self.out_proj = Linear(cfg.value_dim, hidden)
        self.qkvz: FusedLinear | None = None  # in_proj_qkv and in_proj_z as one matmul, set by prepare
        self.ba: FusedLinear | None = None  # in_proj_b and in_proj_a as one matmul
        self.state: LayerState | None = None  # this layer's state slots, set by the model runner

    def prepare(self) -> None:
        self.qkvz = fuse_linears([self.in_proj_qkv, self.in_proj_z])
        self.ba = fuse_linears([self.in_proj_b, self.in_proj_a])

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        if self.qkvz is not None:
            qkv, z = self.qkvz(x).split([cfg.conv_dim, cfg.value_dim], dim=-1)
        else:
            qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        if self.ba is not None:
            b, a = self.ba(x).split([cfg.num_v_heads, cfg.num_v_heads], dim=-1)
        else:
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        return qkv, z, b, a

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``mixed [..., conv_dim]`` -> q, k ``[..., Hv, Dk]`` (key heads repeated for their value heads), v."""
        cfg = self.cfg
        q, k, v = mixed.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = q.reshape(*q.shape[:-1], cfg.num_k_heads, cfg.k_head_dim)
        k = k.reshape(*k.shape[:-1], cfg.num_k_heads, cfg.k_head_dim)
        v = v.reshape(*v.shape[:-1], cfg.num_v_heads, cfg.v_head_dim)
        repeat = cfg.num_v_heads // cfg.num_k_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
        return q, k, v

    def forward(self, rope: Any, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x [T, hidden]`` (``rope`` unused: the layer has no positions) -> ``[T, hidden]``; updates the slots."""
        assert self.state is not None and meta.state_slots is not None, "the model runner sets the state slots"
        qkv, z, b, a = self._project(x)
        g, beta = decay_and_strength(a, b, self.A_log, self.dt_bias)
        weight = self.conv1d.weight[:, 0, :]
        if meta.is_prefill:
            core = self._prefill(qkv, g, beta, weight, meta)
        else:
            core = self._decode(qkv, g, beta, weight, meta.state_slots)
        t, cfg = x.shape[0], self.cfg
        core = self.norm(core.reshape(-1, cfg.v_head_dim), z.reshape(-1, cfg.v_head_dim))
        return self.out_proj(core.reshape(t, cfg.value_dim))

    def _decode(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, slots: list[int]
    ) -> torch.Tensor:
        """One token per sequence, the batch at once: read each slot, step, write it back."""
        assert self.state is not None
        index = torch.tensor(slots, dtype=torch.int64, device=qkv.device)
        conv_state = self.state.conv.index_select(0, index)
        mixed, conv_state = causal_conv(qkv[:, :, None], conv_state, weight)  # [B, C, 1]
        q, k, v = self._heads(mixed[:, :, 0])
        recurrent = self.state.recurrent.index_select(0, index)
        out, recurrent = recurrent_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], recurrent)
        self.state.conv.index_copy_(0, index, conv_state.to(self.state.conv.dtype))
        self.state.recurrent.index_copy_(0, index, recurrent)
        return out[:, 0]

    def _prefill(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Each sequence's new tokens in turn, from zeros at position 0 or from its slot's state."""
        assert self.state is not None and meta.state_slots is not None
        out = torch.empty(qkv.shape[0], self.cfg.num_v_heads, self.cfg.v_head_dim, dtype=qkv.dtype, device=qkv.device)
        start = 0
        for n, ctx, slot in zip(meta.query_lens, meta.context_lens_list, meta.state_slots, strict=True):
            rows = slice(start, start + n)
            fresh = ctx == n  # the step starts the sequence: a new prompt or a preempted one recomputed
            conv_state = None if fresh else self.state.conv[slot : slot + 1]
            mixed, conv_state = causal_conv(qkv[rows].T[None], conv_state, weight)
            q, k, v = self._heads(mixed[0].T)
            recurrent = None if fresh else self.state.recurrent[slot]
            if n == 1 and recurrent is not None:  # one more token of a chunked prefill: the decode form
                o, recurrent = recurrent_rule(
                    q[None], k[None], v[None], g[None, rows], beta[None, rows], recurrent[None]
                )
                o, recurrent = o[0], recurrent[0]
            else:
                o, recurrent = chunked_rule(q, k, v, g[rows], beta[rows], recurrent)
            self.state.conv[slot] = conv_state[0].to(self.state.conv.dtype)
            self.state.recurrent[slot] = recurrent
            out[rows] = o
            start += n
        return out
