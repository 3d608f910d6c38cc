"""Mixture-of-experts blocks with one ``nn.Linear`` per expert projection.

transformers 5 holds a sparse MLP's experts as fused 3-D parameters (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]) and converts the per-expert tensors of a checkpoint into them on load. Solvers,
scheme assignment, the checkpoint writer and the coverage audit all work per linear, and the checkpoints vLLM and
llm-compressor read name each expert's projections, so quantkit swaps each sparse MLP for :class:`UnfusedMoE`:
the same router (transformers' own module, so routing is computed as transformers computes it), one
:class:`ExpertMLP` per expert under the checkpoint's names, and the shared expert where the family has one. The
module sits under the path checkpoints store (Mixtral: ``block_sparse_moe``), so tensors load by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional

from quantkit.model import gpt_oss
from quantkit.model.architectures import ArchSpec, MoESpec
from quantkit.model.blocks import get_module


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, its linears named as the family's checkpoints name them."""

    def __init__(
        self,
        names: tuple[str, str, str],
        hidden: int,
        intermediate: int,
        act: Callable,
        like: torch.Tensor,
        bias: bool = False,
        gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.names = names
        self.act_fn = act
        self.gated = gated  # down_proj's input from gate's and up's outputs (None: act(gate) * up)
        shape_kw = {"bias": bias, "device": like.device, "dtype": like.dtype}
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, **shape_kw))
        setattr(self, up, nn.Linear(hidden, intermediate, **shape_kw))
        setattr(self, down, nn.Linear(intermediate, hidden, **shape_kw))

    @property
    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        gate, up, down = (getattr(self, name) for name in self.names)
        return gate, up, down

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj's input: ``act(gate(x)) * up(x)`` (gpt_oss: its clamped SwiGLU)."""
        gate, up, _ = self.projections
        if self.gated is not None:
            return self.gated(gate(x), up(x))
        return self.act_fn(gate(x)) * up(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projections[2](self.activation(x))


class UnfusedMoE(nn.Module):
    """A sparse MLP computed as transformers computes it, with per-expert linears."""

    def __init__(self, original: nn.Module, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        fused = original.experts
        gate_up, down = fused.gate_up_proj, fused.down_proj  # [E, 2I, H], [E, H, I] (gpt_oss: [E, H, 2I], [E, I, H])
        interleaved = spec.fused_layout == gpt_oss.INTERLEAVED
        num, hidden, inter = (
            gate_up.shape[0],
            gate_up.shape[1 if interleaved else 2],
            down.shape[1 if interleaved else 2],
        )
        setattr(self, spec.router, getattr(original, spec.router))  # transformers' router, under the same name
        gated = None
        if spec.expert_activation == gpt_oss.CLAMPED_SWIGLU:
            alpha, limit = float(fused.alpha), float(fused.limit)

            def gated(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
                return gpt_oss.clamped_swiglu(g, u, alpha, limit)

        act = getattr(fused, "act_fn", None)
        experts = nn.ModuleList(
            ExpertMLP(spec.expert_linears, hidden, inter, act, gate_up, spec.expert_bias, gated) for _ in range(num)
        )
        setattr(self, spec.experts, experts)
        if interleaved and not gate_up.is_meta:
            tensors = {
                name: getattr(fused, name)
                for name in (gpt_oss.GATE_UP, gpt_oss.GATE_UP_BIAS, gpt_oss.DOWN, gpt_oss.DOWN_BIAS)
            }
            with torch.no_grad():
                for e, expert in enumerate(experts):
                    for linear, leaf in zip(expert.projections, ("gate_proj", "up_proj", "down_proj"), strict=True):
                        linear.weight.copy_(gpt_oss.expert_part(tensors, e, leaf, "weight"))
                        linear.bias.copy_(gpt_oss.expert_part(tensors, e, leaf, "bias"))
        elif not gate_up.is_meta:  # a loaded model: the fused tensors split into each expert's linears
            with torch.no_grad():
                for e, expert in enumerate(experts):
                    g, u, d = expert.projections
                    g.weight.copy_(gate_up[e, :inter])
                    u.weight.copy_(gate_up[e, inter:])
                    d.weight.copy_(down[e])
        if spec.shared_expert is not None:
            setattr(self, spec.shared_expert, getattr(original, spec.shared_expert))
        if spec.shared_expert_gate is not None:
            setattr(self, spec.shared_expert_gate, getattr(original, spec.shared_expert_gate))

    # methods, not properties: the modules themselves live under the same attribute names ("gate", "experts")
    def router_module(self) -> nn.Module:
        return getattr(self, self.spec.router)

    def expert_modules(self) -> nn.ModuleList:
        return getattr(self, self.spec.experts)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights and chosen experts, both [N, k], as transformers' router gives them."""
        _, weights, chosen = self.router_module()(flat)
        return weights, chosen

    def shared(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output (behind its sigmoid gate), or None for a family without one."""
        if self.spec.shared_expert is None:
            return None
        out = getattr(self, self.spec.shared_expert)(flat)
        if self.spec.shared_expert_gate is not None:
            out = functional.sigmoid(getattr(self, self.spec.shared_expert_gate)(flat)) * out
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1])
        weights, chosen = self.route(flat)
        out = torch.zeros_like(flat)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            routed = self.expert_modules()[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, routed.to(out.dtype))
        shared = self.shared(flat)
        if shared is not None:
            out = out + shared
        # gpt_oss's decoder layer unpacks (hidden, router scores); nothing quantkit runs reads the scores
        return (out.reshape(shape), None) if self.spec.returns_router_scores else out.reshape(shape)

    def routed_counts(self, flat: torch.Tensor) -> torch.Tensor:
        """How many of the tokens ``flat`` [N, H] each expert receives (int64 [E])."""
        _, chosen = self.route(flat)
        return torch.bincount(chosen.reshape(-1), minlength=len(self.expert_modules()))


def unfuse_experts(model: nn.Module, arch: ArchSpec) -> int:
    """Swap every sparse MLP of ``model`` (transformers' fused experts) for an :class:`UnfusedMoE` under the path
    its checkpoints store; the weights are split when loaded, left on the meta device when not. The number of
    blocks changed (0 for a dense family or a model already unfused)."""
    if arch.moe is None:
        return 0
    changed = 0
    for layer in get_module(model, arch.layers_path):
        original = getattr(layer, arch.moe.hf_path)
        if isinstance(original, UnfusedMoE):
            continue
        unfused = UnfusedMoE(original, arch.moe)
        del layer._modules[arch.moe.hf_path]
        layer.add_module(arch.mlp_path, unfused)
        if arch.mlp_path != arch.moe.hf_path:
            # the decoder layer's forward calls self.<hf_path>: an alias outside the module registry, so that
            # state dicts name the module once, by the checkpoint's path
            object.__setattr__(layer, arch.moe.hf_path, unfused)
        changed += 1
    return changed
