"""Sparse mixture-of-experts MLP for the runtime's decoder (Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss).

A router (kept in float: quantized checkpoints list it in quantization_config's ignore) scores every token against
every expert; each token goes to its top-k routed experts, whose outputs are summed with the routing weights; an
optional shared expert (Qwen2-MoE) runs on every token behind a sigmoid gate. Routing follows transformers' router
and experts classes step by step (softmax in fp32, top-k, optional renormalisation, weights cast back or not, a
per-token sum in expert order) so that fp32 greedy decoding matches ``generate``. gpt-oss differs in three places:
its router has a bias and softmaxes the top-k logits among themselves, every expert projection has a bias, and the
experts' activation is its clamped SwiGLU (:mod:`quantkit.model.gpt_oss`).

Module names mirror the checkpoint's (``<mlp_path>.gate``, ``<mlp_path>.experts.<e>.<gate|up|down>``,
``<mlp_path>.shared_expert.*``, ``<mlp_path>.shared_expert_gate``) as the architecture table
(:class:`~quantkit.model.architectures.MoESpec`) names them, so checkpoint tensors load by name and every expert
projection is a runtime :class:`~quantkit.runtime.linear.Linear` that takes the checkpoint's quantization scheme.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.model import gpt_oss
from quantkit.model.architectures import ArchSpec, MoESpec
from quantkit.runtime.layers import MLP
from quantkit.runtime.linear import FusedLinear, Linear, fuse_linears

# config.json keys the MoE path reads, filled from transformers' config class where a checkpoint omits them:
# transformers' save_pretrained writes every key, but hand-written hub configs leave defaults out, and the runtime's
# own fallbacks (e.g. rms_norm_eps 1e-6) are not every family's (Mixtral's is 1e-5).
_DEFAULTED_KEYS = (
    "num_experts_per_tok",
    "norm_topk_prob",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size",  # Mixtral's experts'
    "decoder_sparse_step",
    "mlp_only_layers",
    "rms_norm_eps",
    "max_position_embeddings",
    "swiglu_alpha",  # gpt_oss's clamped SwiGLU
    "swiglu_limit",
)


def with_config_defaults(model_type: str, cfg: Mapping[str, Any], spec: MoESpec) -> dict[str, Any]:
    """``cfg`` with the MoE keys it omits taken from transformers' config class for ``model_type`` (as
    ``AutoConfig.from_pretrained`` would read them)."""
    from transformers import AutoConfig  # lazily: only MoE checkpoints need the config classes' defaults

    defaults = AutoConfig.for_model(model_type)
    filled = dict(cfg)
    for key in _DEFAULTED_KEYS:
        value = getattr(defaults, key, None)
        if key not in filled and value is not None:
            filled[key] = value
    if not any(filled.get(key) for key in spec.num_experts_keys):
        # Qwen3-MoE and Mixtral map num_experts onto num_local_experts (attribute_map): the attribute reads either
        filled[spec.num_experts_keys[0]] = defaults.num_experts
    return filled


@dataclass(slots=True, frozen=True)
class MoEConfig:
    """What the runtime needs to build one sparse MLP per decoder layer."""

    path: str  # where a decoder layer holds the block, as checkpoints name it ("mlp"; Mixtral: "block_sparse_moe")
    spec: MoESpec
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    renormalize: bool  # top-k weights divided by their sum
    float_weights: bool  # routing weights stay fp32 when scaling expert outputs (MoESpec.float_routing_weights)
    shared_intermediate_size: int = 0  # of the shared expert (0: none)
    swiglu: tuple[float, float] | None = None  # gpt_oss's clamped SwiGLU (alpha, limit); None: silu(gate) * up

    @classmethod
    def from_hf(cls, arch: ArchSpec, cfg: Mapping[str, Any]) -> MoEConfig:
        """From an architecture expanded for ``cfg`` (:meth:`ArchSpec.for_config`) and config.json with its
        defaults filled (:func:`with_config_defaults`)."""
        assert arch.moe is not None and arch.num_experts > 0
        moe = arch.moe
        renormalize = moe.renormalize_key is None or bool(cfg.get(moe.renormalize_key, False))
        shared = int(cfg["shared_expert_intermediate_size"]) if arch.moe.shared_expert is not None else 0
        return cls(
            path=arch.mlp_path,
            spec=arch.moe,
            num_experts=arch.num_experts,
            top_k=int(cfg[arch.moe.top_k_key]),
            intermediate_size=int(cfg[moe.expert_size_key]),
            renormalize=renormalize,
            float_weights=moe.float_routing_weights,
            shared_intermediate_size=shared,
            swiglu=(
                (float(cfg["swiglu_alpha"]), float(cfg["swiglu_limit"]))
                if moe.expert_activation == gpt_oss.CLAMPED_SWIGLU
                else None
            ),
        )


class FloatLinear(nn.Module):
    """A linear a checkpoint keeps in float (the router, the shared expert's gate; a bias only on gpt_oss's router).
    Not a runtime :class:`Linear`, so no quantization_config target ever swaps it for quantized buffers."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def prepare(self, dtype: torch.dtype) -> None:
        # transformers runs it in the model's dtype too (the router's softmax then goes to fp32)
        self.weight = nn.Parameter(self.weight.to(dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Expert(nn.Module):
    """One routed expert, SwiGLU ``down(silu(gate(x)) * up(x))``, its linears under the family's checkpoint names
    (``gate_proj``/``up_proj``/``down_proj``; Mixtral ``w1``/``w3``/``w2``)."""

    def __init__(
        self,
        names: tuple[str, str, str],
        hidden: int,
        intermediate: int,
        bias: bool = False,
        swiglu: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        self.names = names
        self.swiglu = swiglu  # gpt_oss's (alpha, limit)
        gate, up, down = names
        self.add_module(gate, Linear(hidden, intermediate, bias))
        self.add_module(up, Linear(hidden, intermediate, bias))
        self.add_module(down, Linear(intermediate, hidden, bias))
        self.gate_up: FusedLinear | None = None  # gate and up as one matmul, set by prepare

    def _linears(self) -> tuple[Linear, Linear, Linear]:
        gate, up, down = (self._modules[name] for name in self.names)
        assert isinstance(gate, Linear) and isinstance(up, Linear) and isinstance(down, Linear)
        return gate, up, down

    def prepare(self) -> None:
        gate, up, _ = self._linears()
        self.gate_up = fuse_linears([gate, up])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_lin, up_lin, down = self._linears()
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = gate_lin(x), up_lin(x)
        if self.swiglu is not None:
            return down(gpt_oss.clamped_swiglu(gate, up, *self.swiglu))
        return down(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Router + routed experts (+ gated shared expert) over flattened tokens ``[T, H]``."""

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        spec = self.spec = cfg.spec
        self.top_k, self.renormalize, self.float_weights = cfg.top_k, cfg.renormalize, cfg.float_weights
        # registered under the checkpoint's names (MoESpec), read back through the typed accessors below
        self.add_module(spec.router, FloatLinear(hidden, cfg.num_experts, bias=spec.topk_then_softmax))
        experts = (
            Expert(spec.expert_linears, hidden, cfg.intermediate_size, spec.expert_bias, cfg.swiglu)
            for _ in range(cfg.num_experts)
        )
        self.add_module(spec.experts, nn.ModuleList(experts))
        if spec.shared_expert is not None:
            self.add_module(spec.shared_expert, MLP(hidden, cfg.shared_intermediate_size))  # fused by CausalLM
        if spec.shared_expert_gate is not None:
            self.add_module(spec.shared_expert_gate, FloatLinear(hidden, 1))

    def _float(self, name: str | None) -> FloatLinear | None:
        module = None if name is None else self._modules[name]
        assert module is None or isinstance(module, FloatLinear)
        return module

    def router_linear(self) -> FloatLinear:
        router = self._float(self.spec.router)
        assert router is not None
        return router

    def expert_modules(self) -> list[Expert]:
        experts = self._modules[self.spec.experts]
        assert isinstance(experts, nn.ModuleList)
        return [e for e in experts if isinstance(e, Expert)]

    def shared_modules(self) -> tuple[MLP, FloatLinear | None] | None:
        """The shared expert and its gate (None: the family has none)."""
        if self.spec.shared_expert is None:
            return None
        mlp = self._modules[self.spec.shared_expert]
        assert isinstance(mlp, MLP)
        return mlp, self._float(self.spec.shared_expert_gate)

    def prepare(self, dtype: torch.dtype) -> None:
        """After the Linears are prepared: router and shared-expert gate in ``dtype``, each expert's gate/up fused
        (the shared expert is an :class:`MLP`, which the model prepares with the dense ones)."""
        for linear in (self.router_linear(), self._float(self.spec.shared_expert_gate)):
            if linear is not None:
                linear.prepare(dtype)
        for expert in self.expert_modules():
            expert.prepare()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts ``[T, k]`` and their weights ``[T, k]``, as transformers' TopKRouter computes
        them: softmax over the router logits in fp32, top-k, optionally renormalised, then (Qwen) cast back to the
        compute dtype; Mixtral keeps them in fp32."""
        logits = self.router_linear()(x)
        if self.spec.topk_then_softmax:  # gpt_oss: the top-k logits softmaxed among themselves, in their dtype
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return experts, torch.softmax(top, dim=-1, dtype=top.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.float_weights else weights.to(logits.dtype)

    def routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of ``weight * expert(x)``, every hit expert run once on its tokens.

        The ``T*k`` assignments are sorted by expert (stable, so a token's rows stay in expert order), each expert's
        contiguous run of rows goes through it as one batch, and the weighted rows are added back to their tokens
        in that order: the order transformers' per-expert loop adds them in, so the sums round alike (on the CPU;
        CUDA's atomic adds may sum more than two rows of a token in another order).
        """
        modules = self.expert_modules()
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k  # the token of each sorted assignment
        counts = torch.bincount(flat, minlength=len(modules)).tolist()  # one host sync per layer
        rows = x.index_select(0, tokens)
        outs, start = [], 0
        for expert, n in zip(modules, counts, strict=True):
            if n:
                outs.append(expert(rows[start : start + n]))
                start += n
        # multiplied in the weights' dtype (fp32 for Mixtral), then cast, as transformers' experts do
        weighted = torch.cat(outs) * weights.reshape(-1, 1).index_select(0, order)
        return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x
        experts, weights = self.route(x)
        out = self.routed(x, experts, weights)
        shared = self.shared_modules()
        if shared is not None:  # Qwen2-MoE: routed + sigmoid(gate(x)) * shared(x), in transformers' order
            mlp, gate = shared
            shared_out = mlp(x)
            out = out + (torch.sigmoid(gate(x)) * shared_out if gate is not None else shared_out)
        return out
