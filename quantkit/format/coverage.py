"""The coverage audit of a checkpoint: every weight of the model (one row per module, all its stored tensors), its
kind, the scheme the run meant it to get and the one it is written in, why they differ (a layout fallback, a solve
that fell back to round-to-nearest, a linear kept in float by ``--ignore`` or a plan), and its stored bytes, summed
per kind.

What is written (schemes, shapes, bytes) is read from the safetensors headers and config.json; what was meant comes
from the run log's ``coverage`` entry, which ``quantize`` records (:mod:`quantkit.quantization.coverage_intent`).
Bytes are the tensors' data bytes, headers excluded, so the audit's total is the shards' sizes less their headers.
The quantized fraction is over the weights of the linears inside the decoder blocks (the kinds with
``Kind.linears``): embeddings, the head, norms and scale-only modules are not in it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.format.files import read_checkpoint_config, read_run_log, shard_files
from quantkit.format.quantization_config import QuantizationLayout, parse_quantization_config
from quantkit.format.safetensors_stream import StoredTensor, stored_tensors
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import PACKED, SCALE, SHAPE, WEIGHT

FLOAT = "float"  # the scheme of a weight stored in the model's own dtype
UNKNOWN = "-"  # no run log recorded what the run meant (a checkpoint quantkit did not write)
COVERAGE = "coverage"  # the run log's key


@dataclass(frozen=True, slots=True)
class Kind:
    """A kind of weight: ``pattern`` is searched in the module name; ``linears``: its 2-D weights are linears the
    quantized fraction counts."""

    name: str
    pattern: re.Pattern[str]
    linears: bool


ATTENTION, MLP, EMBEDDINGS, HEAD, OTHER = "attention", "dense MLP", "embeddings", "head", "norms/other"
ROUTED, SHARED, ROUTER = "routed experts", "shared experts", "router"
# a hybrid model's linear-attention layers (Qwen3.5's gated DeltaNet): the projections quantize writes, and the
# in_proj_b / in_proj_a gates ([heads, H]: the decay and write strength) that it keeps in float like the router
LINEAR_ATTENTION, LINEAR_GATES = "linear attention", "linear-attention gates"
# Matched in this order, the first match wins; a module no rule matches is OTHER. Norms come before attention
# because Qwen3's q_norm and k_norm live under self_attn. MoE kinds (routed experts under <moe>.experts.N, the
# shared expert, the router <moe>.gate (gpt_oss: <moe>.router) and the shared expert gate, where <moe> is mlp or
# block_sparse_moe) go before MLP, so that the dense rule only takes what they leave.
KINDS: tuple[Kind, ...] = (
    Kind(EMBEDDINGS, re.compile(r"(^|\.)embed_tokens$"), linears=False),
    Kind(HEAD, re.compile(r"(^|\.)lm_head$"), linears=False),
    Kind(OTHER, re.compile(r"norm[^.]*$"), linears=False),
    Kind(ATTENTION, re.compile(r"\.self_attn(\.|$)"), linears=True),
    Kind(LINEAR_ATTENTION, re.compile(r"\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$"), linears=True),
    Kind(LINEAR_GATES, re.compile(r"\.linear_attn\.in_proj_[ab]$"), linears=False),
    Kind(ROUTED, re.compile(r"\.experts\.\d+\."), linears=True),
    Kind(SHARED, re.compile(r"\.shared_expert\."), linears=True),
    # the router and the shared expert's gate stay in float by design (quantize never plans them), like norms
    Kind(ROUTER, re.compile(r"\.(mlp|block_sparse_moe)\.(gate|shared_expert_gate|router)$"), linears=False),
    Kind(MLP, re.compile(r"\.mlp\."), linears=True),
)
# how tables list them
KIND_ORDER = (ATTENTION, LINEAR_ATTENTION, MLP, ROUTED, SHARED, ROUTER, LINEAR_GATES, EMBEDDINGS, HEAD, OTHER)


_UNMATCHED = Kind(OTHER, re.compile(r"(?!)"), linears=False)  # a module no rule names (a rotation's, say)


def kind_of(module: str) -> Kind:
    return next((k for k in KINDS if k.pattern.search(module)), _UNMATCHED)


@dataclass(frozen=True, slots=True)
class Intent:
    """What the run meant for one linear: ``scheme`` (a scheme name, or FLOAT), why it is float (``"ignore"``,
    ``"plan"``), the layout change the layout policy made (``"g128 -> g64"``), and whether its solve fell back to
    round-to-nearest (GPTQ on a Hessian it could not factor)."""

    scheme: str
    float_by: str = ""
    layout: str = ""
    rtn_fallback: bool = False


@dataclass(slots=True)
class WeightRow:
    name: str  # the module (model.layers.0.self_attn.q_proj); its tensors are <name>.<part>
    kind: str
    linear: bool  # a block linear: counted in the quantized fraction
    intended: str  # a scheme name, FLOAT, or UNKNOWN
    actual: str  # the scheme it is written in, or FLOAT
    params: int  # the weight's elements (0 for a module that stores only scales, e.g. a KV cache's)
    bytes: int  # every tensor of the module: packed weight, scales, zero points, shape, bias
    float_by: str = ""
    layout: str = ""
    rtn_fallback: bool = False

    @property
    def note(self) -> str:
        """Why this weight reads differently from the scheme asked, in words."""
        notes = [f"layout {self.layout}"] if self.layout else []
        notes += ["solved by RTN (GPTQ fell back)"] if self.rtn_fallback else []
        notes += {"ignore": ["kept in float by --ignore"], "plan": ["kept in float by the plan"]}.get(self.float_by, [])
        if self.actual == FLOAT and self.linear and not self.float_by:
            notes.append("written in float")
        return "; ".join(notes)

    @property
    def exceptional(self) -> bool:
        """A linear written in float, in another scheme than asked, or by a fallback solve."""
        changed = self.intended not in (UNKNOWN, self.actual)
        return self.linear and (self.actual == FLOAT or changed or self.rtn_fallback)


@dataclass(slots=True)
class KindSummary:
    kind: str
    modules: int = 0
    params: int = 0
    quantized_params: int = 0
    bytes: int = 0
    schemes: dict[str, int] = field(default_factory=dict)  # actual scheme -> modules
    float_linears: int = 0  # linears written in float, asked for or not
    layout_fallbacks: int = 0
    rtn_fallbacks: int = 0


@dataclass(slots=True)
class CoverageAudit:
    weights: list[WeightRow]
    kinds: list[KindSummary]
    total_bytes: int  # every tensor's data bytes: the shards' sizes less their headers
    linear_params: int
    quantized_linear_params: int
    intent_recorded: bool  # False: no run log said what was meant (intended is UNKNOWN for linears)

    @property
    def quantized_fraction(self) -> float:
        """Of the block linears' weights (params), the part written quantized; 0 when there are none."""
        return self.quantized_linear_params / self.linear_params if self.linear_params else 0.0

    def exceptions(self) -> list[WeightRow]:
        return [row for row in self.weights if row.exceptional]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["quantized_fraction"] = self.quantized_fraction
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CoverageAudit:
        """Inverse of :meth:`to_dict` (a report's or a run log's copy)."""
        return cls(
            weights=[WeightRow(**row) for row in data["weights"]],
            kinds=[KindSummary(**kind) for kind in data["kinds"]],
            total_bytes=data["total_bytes"],
            linear_params=data["linear_params"],
            quantized_linear_params=data["quantized_linear_params"],
            intent_recorded=data["intent_recorded"],
        )


def audit_tensors(
    tensors: Mapping[str, StoredTensor], layout: QuantizationLayout, intents: Mapping[str, Intent] | None
) -> CoverageAudit:
    """The audit of a checkpoint's tensors (name -> stored bytes) under its quantization config; ``intents`` (module
    -> what was meant) from the run, None when unknown."""
    modules: dict[str, dict[str, StoredTensor]] = {}
    for name, stored in tensors.items():
        owner, _, part = name.rpartition(".")
        modules.setdefault(owner, {})[part] = stored
    rows = [_row(owner, parts, layout, intents) for owner, parts in sorted(modules.items(), key=_natural)]
    linear = [row for row in rows if row.linear]
    return CoverageAudit(
        weights=rows,
        kinds=summarize(rows),
        total_bytes=sum(row.bytes for row in rows),
        linear_params=sum(row.params for row in linear),
        quantized_linear_params=sum(row.params for row in linear if row.actual != FLOAT),
        intent_recorded=intents is not None,
    )


def _row(
    owner: str, parts: Mapping[str, StoredTensor], layout: QuantizationLayout, intents: Mapping[str, Intent] | None
) -> WeightRow:
    kind = kind_of(owner)
    scheme = layout.scheme_for(owner) if SCALE in parts else None
    if SCALE in parts and scheme is None:
        raise QuantkitError(f"{owner} is quantized but quantization_config gives it no scheme")
    weight = parts.get(WEIGHT)
    dense = scheme is None and weight is not None and len(weight.shape) == 2
    linear = kind.linears and (scheme is not None or dense)
    n, k = _weight_shape(parts, scheme) if scheme is not None else (0, 0)
    params = n * k if scheme is not None else 0 if weight is None else math.prod(weight.shape)
    intent = (intents or {}).get(owner)
    if intent is None:  # quantize records every block linear; everything else stays float by design
        intent = Intent(UNKNOWN if linear else FLOAT)
    return WeightRow(
        name=owner,
        kind=kind.name,
        linear=linear,
        intended=intent.scheme,
        actual=FLOAT if scheme is None else scheme.name,
        params=params,
        bytes=sum(t.nbytes for t in parts.values()),
        float_by=intent.float_by,
        layout=intent.layout,
        rtn_fallback=intent.rtn_fallback,
    )


def _weight_shape(parts: Mapping[str, StoredTensor], scheme: QuantScheme) -> tuple[int, int]:
    """(out, in) features of a quantized linear: its ``weight_shape`` (packed integers), its packed FP4 codes (two
    a byte) or its unpacked codes (int8 / FP8 ``weight``)."""
    if SHAPE in parts:
        n, k = parts[SHAPE].read_values()
        return int(n), int(k)
    packed, weight = parts.get(PACKED), parts.get(WEIGHT)
    if packed is not None and scheme.is_float and len(packed.shape) == 2:
        return packed.shape[0], 2 * packed.shape[1]
    if weight is not None and len(weight.shape) == 2:
        return weight.shape[0], weight.shape[1]
    raise QuantkitError(f"{SHAPE} of a quantized linear is missing; the checkpoint is incomplete, re-export it")


def _natural(item: tuple[str, Any]) -> list[int | str]:
    """``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", item[0])]


def summarize(rows: list[WeightRow]) -> list[KindSummary]:
    """The rows summed per kind, in KIND_ORDER (kinds with no weight left out)."""
    kinds: dict[str, KindSummary] = {}
    for row in rows:
        summary = kinds.setdefault(row.kind, KindSummary(row.kind))
        summary.modules += 1
        summary.params += row.params
        summary.quantized_params += 0 if row.actual == FLOAT else row.params
        summary.bytes += row.bytes
        summary.schemes[row.actual] = summary.schemes.get(row.actual, 0) + 1
        summary.float_linears += row.linear and row.actual == FLOAT
        summary.layout_fallbacks += bool(row.layout)
        summary.rtn_fallbacks += row.rtn_fallback
    order = {name: i for i, name in enumerate(KIND_ORDER)}
    return sorted(kinds.values(), key=lambda s: (order.get(s.kind, len(order)), s.kind))


def intents_from_log(log: Mapping[str, Any]) -> dict[str, Intent] | None:
    """What the run meant for each linear, as its run log's ``coverage`` entry recorded it (None: not recorded)."""
    coverage = log.get(COVERAGE)
    if not isinstance(coverage, dict) or not coverage.get("intent_recorded"):
        return None
    return {
        row["name"]: Intent(row["intended"], row["float_by"], row["layout"], row["rtn_fallback"])
        for row in coverage.get("weights", [])
        if row.get("linear")
    }


def audit_checkpoint(path: Path, intents: Mapping[str, Intent] | None = None) -> CoverageAudit:
    """The audit of the checkpoint directory ``path``: its shards and config.json, with ``intents`` (default: the
    ones its run log recorded)."""
    path = Path(path)
    layout = parse_quantization_config(read_checkpoint_config(path).get("quantization_config") or {})
    tensors: dict[str, StoredTensor] = {}
    for shard in shard_files(path):
        tensors |= stored_tensors(shard)
    return audit_tensors(tensors, layout, intents if intents is not None else intents_from_log(read_run_log(path)))
