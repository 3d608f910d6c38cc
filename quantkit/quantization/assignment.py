"""Which scheme each linear gets: resolved once, before the layer loop, then written as config groups."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.format.engines import (
    EXPORT_SUPPORT,
    FALLBACK,
    QUANTKIT_ONLY,
    fallback_scheme,
    group_label,
    layout_problem,
    widest_dividing_group,
)
from quantkit.format.moe_engines import moe_layout_problem
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import ArchSpec
from quantkit.model.source_weights import SourceWeights


@dataclass(slots=True)
class SchemeAssignment:
    """Full module name -> scheme, or None for a linear kept in float."""

    schemes: dict[str, QuantScheme | None]
    fallbacks: dict[str, str] = field(default_factory=dict)  # linear -> "g128 -> g64" (--layout-policy fallback)
    asked: dict[str, QuantScheme] = field(default_factory=dict)  # linear -> its scheme before the fallback

    def for_block(self, prefix: str) -> dict[str, QuantScheme | None]:
        """Relative names (e.g. ``self_attn.q_proj``) of one block's linears."""
        start = prefix + "."
        return {name[len(start) :]: s for name, s in self.schemes.items() if name.startswith(start)}

    def quantized(self) -> list[str]:
        return [name for name, s in self.schemes.items() if s is not None]

    def quantization_config(
        self, float_modules: Sequence[str] = (), outer: Mapping[str, QuantScheme] | None = None, **extra: Any
    ) -> dict:
        """compressed-tensors config groups: ``Linear`` for a uniform scheme, exact names when mixed;
        ``float_modules``: linears outside the assignment that stay in float (an MoE router), listed as ignored so
        that a ``Linear`` target does not reach them; ``outer``: modules outside the blocks written quantized (a
        quantized ``lm_head``), each in a group of its own under its exact name (an exact name wins over ``Linear``
        in compressed-tensors and vLLM), and no longer ignored; ``extra``: the rest of
        :func:`build_quantization_config`'s arguments (the KV cache scheme, the activation observer)."""
        distinct = list(dict.fromkeys(s for s in self.schemes.values() if s is not None))
        if not distinct:
            raise QuantkitError("every linear is ignored: nothing would be quantized; loosen --ignore")
        outer = dict(outer or {})
        head = [] if "lm_head" in outer else ["lm_head"]
        outer_groups = [(scheme, [name]) for name, scheme in outer.items()]
        ignore = [*head, *(name for name, s in self.schemes.items() if s is None), *float_modules]
        if len(distinct) == 1:
            return build_quantization_config([(distinct[0], ["Linear"]), *outer_groups], ignore, **extra)
        groups = [(scheme, [n for n, s in self.schemes.items() if s == scheme]) for scheme in distinct]
        return build_quantization_config([*groups, *outer_groups], head, **extra)


def block_linears(arch: ArchSpec, num_layers: int) -> list[str]:
    return [f"{arch.layers_path}.{i}.{linear}" for i in range(num_layers) for linear in arch.for_layer(i).linears]


def float_modules(arch: ArchSpec, num_layers: int) -> list[str]:
    """The linears every run keeps in float (an MoE router and shared-expert gate), by full name."""
    return [f"{arch.layers_path}.{i}.{name}" for i in range(num_layers) for name in arch.for_layer(i).float_linears]


def uniform_assignment(arch: ArchSpec, num_layers: int, scheme: QuantScheme, ignore: list[str]) -> SchemeAssignment:
    patterns = [re.compile(p) for p in ignore]
    schemes: dict[str, QuantScheme | None] = {}
    for name in block_linears(arch, num_layers):
        schemes[name] = None if any(p.search(name) for p in patterns) else scheme
    _check_fused(arch, num_layers, schemes)
    return SchemeAssignment(schemes)


def _check_fused(arch: ArchSpec, num_layers: int, schemes: dict[str, QuantScheme | None]) -> None:
    """Linears that runtimes fuse (q/k/v, gate/up) must share a scheme."""
    for i in range(num_layers):
        for group in arch.for_layer(i).fused_groups:  # a hybrid model's layers differ (ArchSpec.for_layer)
            names = [f"{arch.layers_path}.{i}.{linear}" for linear in group]
            if len({schemes[n] for n in names}) > 1:
                raise QuantkitError(
                    f"{', '.join(names)} are fused by inference engines and must share one scheme; "
                    "adjust --ignore or the plan so they are treated alike"
                )


def fit_layouts(assignment: SchemeAssignment, in_features: Mapping[str, int], policy: str) -> SchemeAssignment:
    """The assignment with every layer's layout checked against what engines load (see ``format.engines``).

    ``strict``: a layout compressed-tensors, transformers or vLLM would refuse is an error naming the layers and
    the fix; ``fallback``: such a group size becomes the largest valid one for that layer (recorded);
    ``quantkit-only``: left as is.
    """
    if policy == QUANTKIT_ONLY:
        return assignment
    problems = {
        name: problem
        for name, scheme in assignment.schemes.items()
        if scheme is not None and (problem := layout_problem(scheme, in_features[name]))
    }
    if not problems:
        return assignment
    schemes = dict(assignment.schemes)
    fallbacks = dict(assignment.fallbacks)
    asked = dict(assignment.asked)
    for name in problems:
        scheme = schemes[name]
        assert scheme is not None
        if policy != FALLBACK or (scheme.act_order and not scheme.static_groups):
            raise QuantkitError(_refusal(problems, schemes, in_features))
        schemes[name] = fallback_scheme(scheme, in_features[name])
        fallbacks[name] = f"{group_label(scheme)} -> {group_label(schemes[name])}"
        asked[name] = scheme
    warnings.warn(fallback_notice(fallbacks), LayoutFallback, stacklevel=2)
    return SchemeAssignment(schemes, fallbacks, asked)


class LayoutFallback(UserWarning):
    """Layers got a smaller group than asked because engines refuse the asked one for their shapes."""


def fallback_notice(fallbacks: Mapping[str, str]) -> str:
    """One line: which layers got which group instead of the asked one, and how to refuse instead."""
    by_change: dict[str, list[str]] = {}
    for name, change in fallbacks.items():
        by_change.setdefault(change, []).append(name)
    parts = [f"{change} on {len(names)} linears ({', '.join(_leaves(names))})" for change, names in by_change.items()]
    return (
        f"layout: {'; '.join(parts)}, whose in-features the group size does not divide (engines refuse a short "
        "last group); --layout-policy strict stops instead"
    )


def _refusal(
    problems: Mapping[str, str], schemes: Mapping[str, QuantScheme | None], in_features: Mapping[str, int]
) -> str:
    head = f"{len(problems)} layers would get a layout compressed-tensors, transformers and vLLM refuse"
    head += f" ({_by_reason(problems)})"
    if any("act-order" in p for p in problems.values()):
        return f"{head}; use --static-groups (the default), or --layout-policy quantkit-only to write it anyway"
    widest = widest_dividing_group([in_features[n] for n, s in schemes.items() if s is not None])
    size = "--group-size -1 (per-channel)" if widest == -1 else f"--group-size {widest}"
    return (
        f"{head}; use {size} (the largest that divides every layer), --layout-policy fallback (a smaller group "
        "on those layers only), or --layout-policy quantkit-only (a short last group only quantkit reads)"
    )


def _by_reason(reasons: Mapping[str, str]) -> str:
    """``reason: linear, linear; reason: linear`` with block indices dropped (``mlp.down_proj``)."""
    grouped: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        grouped.setdefault(reason, []).append(name)
    return "; ".join(f"{reason}: {', '.join(_leaves(names))}" for reason, names in grouped.items())


def _leaves(names: list[str]) -> list[str]:
    """Linear names with the block index dropped (model.layers.3.mlp.down_proj -> mlp.down_proj), once each."""
    return list(dict.fromkeys(re.sub(r"^.*?\.\d+\.", "", name) for name in names))


def check_exports(
    assignment: SchemeAssignment, in_features: Mapping[str, int], formats: list[str], storage: torch.dtype
) -> None:
    """Before any work: every quantized layer can be exported exactly to each of ``formats`` (whose scales are
    float16: scales are stored in the model's dtype, and a float32 model's scales are not float16 values)."""
    if formats and storage == torch.float32:
        raise QuantkitError(
            f"--format {formats[0]} stores float16 scales, but this model is float32 and its scales would be too; "
            "quantize a float16 or bfloat16 copy of the model"
        )
    for fmt in formats:
        judge = EXPORT_SUPPORT[fmt]
        refused = {
            name: verdict.reason
            for name, scheme in assignment.schemes.items()
            if scheme is not None and not (verdict := judge(scheme, in_features[name])).loads
        }
        if refused:
            raise QuantkitError(
                f"--format {fmt} cannot hold {len(refused)} layers exactly ({_by_reason(refused)}); "
                f"change the scheme or drop --format {fmt}"
            )


def fit_expert_layouts(
    assignment: SchemeAssignment, arch: ArchSpec, weights: SourceWeights, num_layers: int, policy: str
) -> SchemeAssignment:
    """Before any work, after :func:`fit_layouts`: a layer's routed experts keep one scheme (vLLM's fused-MoE layer
    holds gate, up and down under one method), so where the layout fallback gave down_proj (whose in-features are
    the expert width) a smaller group than gate/up, every expert linear of the layer takes that smaller group; then
    the scheme is checked against vLLM's fused-MoE rules at the layer's shapes (``format/moe_engines.py``), one
    line naming the problem and the fix otherwise. ``quantkit-only`` writes it anyway (quantkit's own loader and
    runtime read it)."""
    if arch.moe is None or policy == QUANTKIT_ONLY:
        return assignment
    schemes, fallbacks, asked = dict(assignment.schemes), dict(assignment.fallbacks), dict(assignment.asked)
    for i in range(num_layers):
        prefix = f"{arch.layers_path}.{i}."
        names = [prefix + name for name in arch.routed_expert_linears()]
        chosen = [schemes[name] for name in names if schemes.get(name) is not None]
        if not chosen:
            continue
        narrowest = min(chosen, key=lambda scheme: scheme.group_size if (scheme.group_size or 0) > 0 else 1 << 30)
        for name in names:
            if schemes[name] is not None and schemes[name] != narrowest:
                original = asked.get(name, schemes[name])
                asked[name] = original
                fallbacks[name] = f"{group_label(original)} -> {group_label(narrowest)}"
                schemes[name] = narrowest
        gate = prefix + arch.routed_expert_linears(0)[0]  # every expert of a layer has the same shapes
        intermediate, hidden = weights.shape(f"{gate}.weight")
        problem = moe_layout_problem(narrowest, hidden_size=int(hidden), intermediate_size=int(intermediate))
        if problem is not None:
            raise QuantkitError(f"{prefix}{arch.mlp_path} experts: {problem} (or --layout-policy quantkit-only)")
    return SchemeAssignment(schemes, fallbacks, asked)
