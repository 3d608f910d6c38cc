"""Size report of a quantized checkpoint, read from headers only: bits per weight per layer, per scheme and overall;
each scheme's weight format and activation scheme, the KV cache scheme, and where the checkpoint loads.

Layers are listed in natural order (``layers.2`` before ``layers.10``); :class:`SchemeGroup` sums the layers that
share a scheme (the groups add up to the quantized totals). Sizes are shown in MB (10^6 bytes, as everywhere).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from quantkit.errors import QuantkitError
from quantkit.format.engines import VLLM_VERSION
from quantkit.format.files import read_checkpoint_config, read_run_log, shard_files
from quantkit.format.kv_cache import KV_SCALES
from quantkit.format.loads_in import EngineVerdict, LayerShape, loads_in
from quantkit.format.quantization_config import QuantizationLayout, parse_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.scheme_labels import activation_format, kv_cache_format, weight_format
from quantkit.format.sizes import format_mb, mb_number
from quantkit.format.tensors import G_IDX, GLOBAL, INPUT_GLOBAL, INPUT_SCALE, PACKED, SCALE, SHAPE, WEIGHT, ZERO
from quantkit.format.whole_model import PartBytes, whole_model_bytes

EMBEDDING_LEAF = "embed_tokens"  # a quantized embedding (--quantize-embedding) is listed with the layers

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table

_BITS = {"BOOL": 1, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "I16": 16, "F16": 16, "BF16": 16}
_BITS |= {"I32": 32, "F32": 32, "U32": 32, "I64": 64, "F64": 64, "U64": 64}
_QUANT_PARTS = (PACKED, WEIGHT, SCALE, ZERO, G_IDX, GLOBAL)  # counted in bits per weight
_UNCOUNTED_PARTS = (SHAPE, INPUT_SCALE, INPUT_GLOBAL)  # a layer's, but not its weight's storage


@dataclass(slots=True)
class LayerReport:
    name: str
    scheme: str
    out_features: int
    in_features: int
    bits_per_weight: float  # (weight + scale + zero-point + g_idx bits) / (N * K)
    fallback: str = ""  # "g128 -> g64" when --layout-policy fallback changed this layer's group size
    bytes: int = 0  # stored bytes of the layer's weight_packed, scale, zero point and g_idx

    @property
    def params(self) -> int:
        return self.out_features * self.in_features


@dataclass(slots=True)
class SchemeGroup:
    """The quantized layers sharing one scheme, summed."""

    scheme: str
    layers: int = 0
    params: int = 0
    bytes: int = 0  # as LayerReport.bytes, summed
    bits_per_weight: float = 0.0  # the group's stored bits / its params
    weights: str = ""  # e.g. "NVFP4 g16, FP8 scales + global" (quantkit.format.scheme_labels)
    activations: str = ""  # e.g. "FP8 dynamic per-token", "16-bit"


@dataclass(slots=True)
class CheckpointReport:
    path: str
    layers: list[LayerReport] = field(default_factory=list)  # natural order of names (layers.2 before layers.10)
    groups: list[SchemeGroup] = field(default_factory=list)  # one per scheme, fewest bits per weight first
    quantized_params: int = 0
    quantized_bytes: int = 0  # the quantized layers' stored bytes (sum of LayerReport.bytes)
    total_params: int = 0
    avg_bits_per_weight: float = 0.0  # over quantized Linears only
    model_bits_per_weight: float = 0.0  # every stored bit over the source model's parameters (embeddings included)
    untied_head_bytes: int = 0  # a head the rotation had to untie from the embedding (counted in the size)
    tensor_bytes: int = 0  # every tensor's data bytes (the shards less their headers): the whole model's size
    parts: list[PartBytes] = field(default_factory=list)  # tensor_bytes by what they hold (format.whole_model)
    checkpoint_bytes: int = 0  # safetensors files on disk
    dense_bf16_bytes: int = 0
    dense_from_reference: bool = False  # dense size measured from a reference checkpoint
    kv_cache: str = "16-bit"  # the KV cache scheme, e.g. "FP8, static per-tensor k/v scales"
    loads_in: list[EngineVerdict] = field(default_factory=list)

    @property
    def compression_ratio(self) -> float:
        return self.dense_bf16_bytes / self.checkpoint_bytes if self.checkpoint_bytes else math.nan

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["compression_ratio"] = self.compression_ratio
        return data


@dataclass(slots=True)
class _TensorInfo:
    shape: tuple[int, ...]
    bits: int  # bits per element
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def total_bits(self) -> int:
        return self.numel * self.bits


def _headers(files: list[Path]) -> dict[str, _TensorInfo]:
    infos: dict[str, _TensorInfo] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = handle.get_slice(key)
                dtype = sl.get_dtype()
                if dtype not in _BITS:
                    raise QuantkitError(f"tensor {key!r} in {f.name} has unsupported dtype {dtype}")
                infos[key] = _TensorInfo(tuple(sl.get_shape()), _BITS[dtype], f)
    return infos


def _weight_shape(infos: dict[str, _TensorInfo], prefix: str, scheme: QuantScheme) -> tuple[int, int]:
    """(out, in) features of a quantized Linear: its ``weight_shape`` (pack-quantized), its packed FP4 codes (two a
    byte) or its unpacked codes (int8 / FP8 ``weight``)."""
    key = f"{prefix}.{SHAPE}"
    if key in infos:
        with safe_open(str(infos[key].file), framework="pt") as handle:
            n, k = handle.get_tensor(key).tolist()
        return int(n), int(k)
    packed, weight = infos.get(f"{prefix}.{PACKED}"), infos.get(f"{prefix}.{WEIGHT}")
    if packed is not None and scheme.is_float and len(packed.shape) == 2:
        return packed.shape[0], 2 * packed.shape[1]
    if weight is not None and len(weight.shape) == 2:
        return weight.shape[0], weight.shape[1]
    raise QuantkitError(f"checkpoint tensor {key!r} is missing; the checkpoint is incomplete, re-export it")


def _quantized_prefixes(infos: dict[str, _TensorInfo], layout: QuantizationLayout) -> list[tuple[str, QuantScheme]]:
    """Every quantized Linear (it has a ``weight_scale``; a dense weight has none) with its scheme, in natural order."""
    found = []
    for key in infos:
        if not key.endswith("." + SCALE):
            continue
        prefix = key.removesuffix("." + SCALE)
        scheme = layout.scheme_for(prefix)
        if scheme is None:
            raise QuantkitError(f"{prefix} is quantized but quantization_config gives it no scheme")
        found.append((prefix, scheme))
    return sorted(found, key=lambda item: natural_key(item[0]))


def _safetensors_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in shard_files(path))


def natural_key(name: str) -> list[int | str]:
    """Sort key reading digit runs as numbers: ``layers.2`` sorts before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def scheme_groups(layers: list[LayerReport], schemes: dict[str, QuantScheme] | None = None) -> list[SchemeGroup]:
    """The layers summed per scheme, fewest bits per weight first; ``schemes`` (name -> scheme) describes each."""
    groups: dict[str, SchemeGroup] = {}
    bits: dict[str, float] = {}
    for layer in layers:
        scheme = (schemes or {}).get(layer.scheme)
        described = {} if scheme is None else _described(scheme)
        group = groups.setdefault(layer.scheme, SchemeGroup(layer.scheme, **described))
        group.layers += 1
        group.params += layer.params
        group.bytes += layer.bytes
        bits[layer.scheme] = bits.get(layer.scheme, 0.0) + layer.bits_per_weight * layer.params
    for name, group in groups.items():
        group.bits_per_weight = bits[name] / group.params if group.params else 0.0
    return sorted(groups.values(), key=lambda g: (g.bits_per_weight, g.scheme))


def _described(scheme: QuantScheme) -> dict[str, str]:
    return {"weights": weight_format(scheme), "activations": activation_format(scheme.activations)}


def inspect_checkpoint(path: Path, reference: Path | None = None) -> CheckpointReport:
    """Per-layer and total bits per weight of a compressed-tensors checkpoint, each scheme described, the KV cache
    scheme and where it loads (tensors are not loaded: headers, and ``weight_shape`` where stored)."""
    path = Path(path)
    layout = parse_quantization_config(read_checkpoint_config(path).get("quantization_config") or {})
    files = shard_files(path)
    infos = _headers(files)
    report = CheckpointReport(path=str(path), checkpoint_bytes=_safetensors_bytes(path))
    report.kv_cache = kv_cache_format(layout.kv_cache)

    # the KV cache's k/v scales belong to no Linear and are no source parameter
    consumed: set[str] = {key for key in infos if key.endswith(tuple("." + name for name in KV_SCALES))}
    shapes: list[LayerShape] = []
    embedding: LayerShape | None = None
    schemes: dict[str, QuantScheme] = {}
    fallbacks = _layout_fallbacks(path)
    quant_bits = 0
    for prefix, scheme in _quantized_prefixes(infos, layout):
        n, k = _weight_shape(infos, prefix, scheme)
        counted = [f"{prefix}.{p}" for p in _QUANT_PARTS if f"{prefix}.{p}" in infos]
        bits = sum(infos[p].total_bits for p in counted)
        consumed.update(counted, (f"{prefix}.{p}" for p in _UNCOUNTED_PARTS if f"{prefix}.{p}" in infos))
        schemes[scheme.name] = scheme
        layer = LayerReport(prefix, scheme.name, n, k, bits / (n * k), fallbacks.get(prefix, ""), bits // 8)
        report.layers.append(layer)
        if prefix.endswith(EMBEDDING_LEAF):  # a lookup, not a matmul: the engines' embedding rules apply
            embedding = LayerShape(prefix, scheme, n, k)
        else:
            shapes.append(LayerShape(prefix, scheme, n, k))
        report.quantized_params += n * k
        report.quantized_bytes += layer.bytes
        quant_bits += bits

    report.groups = scheme_groups(report.layers, schemes)

    report.loads_in = loads_in(shapes, layout.kv_cache, embedding)
    other = sum(info.numel for key, info in infos.items() if key not in consumed)
    report.total_params = report.quantized_params + other
    report.avg_bits_per_weight = quant_bits / report.quantized_params if report.quantized_params else 0.0
    untied = _rotation_untied_head(path) or ""
    head = infos.get(untied)
    quantized_head = next((x for x in report.layers if f"{x.name}.weight" == untied), None)  # --quantize-head
    report.untied_head_bytes = head.total_bits // 8 if head is not None else getattr(quantized_head, "bytes", 0)
    head_params = head.numel if head is not None else getattr(quantized_head, "params", 0)
    source_params = report.total_params - head_params
    report.parts = whole_model_bytes(
        {key: (info.total_bits // 8, info.numel) for key, info in infos.items()},
        {x.name: x.params for x in report.layers},
    )
    report.tensor_bytes = sum(part.bytes for part in report.parts)
    report.model_bits_per_weight = 8 * report.tensor_bytes / source_params if source_params else 0.0
    if reference is not None:
        report.dense_bf16_bytes = _safetensors_bytes(Path(reference))
        report.dense_from_reference = True
    else:
        report.dense_bf16_bytes = 2 * report.total_params
    return report


def _rotation_untied_head(path: Path) -> str | None:
    """The head tensor quantize recorded as untied from the embedding by folding a rotation, if any."""
    rotation = read_run_log(path).get("rotation")
    return rotation.get("untied_head") if isinstance(rotation, dict) else None


def _layout_fallbacks(path: Path) -> dict[str, str]:
    """Layers whose group size ``--layout-policy fallback`` changed, as quantize recorded them."""
    fallbacks = read_run_log(path).get("layout_fallbacks")
    return dict(fallbacks) if isinstance(fallbacks, dict) else {}


def render_report(report: CheckpointReport) -> Group:
    """Rich tables: the layers (natural order, one section per scheme), the schemes summed with the totals, then
    where the checkpoint loads."""
    from rich.console import Group

    from quantkit.format.whole_model_table import whole_model_table

    return Group(_layers_table(report), _groups_table(report), whole_model_table(report), _engines_table(report))


def _layers_table(report: CheckpointReport) -> Table:
    from rich.table import Table

    table = Table(title=f"Quantized layers of {report.path}")
    layout = any(x.fallback for x in report.layers)
    for col in ["layer", "scheme", "N", "K", "params", "MB", "bits/w"] + (["layout"] if layout else []):
        table.add_column(col, justify="left" if col in ("layer", "scheme", "layout") else "right")
    for i, group in enumerate(report.groups):
        if i:
            table.add_section()
        for layer in (x for x in report.layers if x.scheme == group.scheme):
            row = [layer.name, layer.scheme, str(layer.out_features), str(layer.in_features), f"{layer.params:,}"]
            row += [mb_number(layer.bytes), f"{layer.bits_per_weight:.3f}"]
            table.add_row(*row, *([f"fallback {layer.fallback}" if layer.fallback else ""] if layout else []))
    table.caption = "layers in natural order, grouped by scheme; MB = 10^6 bytes (packed weights, scales, zeros)"
    return table


def _groups_table(report: CheckpointReport) -> Table:
    from rich.table import Table

    table = Table(title="Per scheme", show_footer=True)
    footer = ["all quantized", "", "", str(len(report.layers)), f"{report.quantized_params:,}"]
    footer += [mb_number(report.quantized_bytes), f"{report.avg_bits_per_weight:.3f}"]
    columns = ("scheme", "weights", "activations", "layers", "params", "MB", "bits/w")
    for col, total in zip(columns, footer, strict=True):
        table.add_column(col, total, justify="left" if col in columns[:3] else "right")
    for group in report.groups:
        row = [group.scheme, group.weights, group.activations, str(group.layers), f"{group.params:,}"]
        table.add_row(*row, mb_number(group.bytes), f"{group.bits_per_weight:.3f}")
    dense_src = "reference" if report.dense_from_reference else "2 B x params"
    table.caption = (
        f"quantized params {report.quantized_params:,} of {report.total_params:,}; "
        f"checkpoint {format_mb(report.checkpoint_bytes)} vs bf16 {format_mb(report.dense_bf16_bytes)} ({dense_src}), "
        f"x{report.compression_ratio:.2f}; whole model {report.model_bits_per_weight:.3f} bits/w"
    )
    table.caption += f"; KV cache: {report.kv_cache}"
    if report.untied_head_bytes:
        table.caption += (
            f"; includes an lm_head of {format_mb(report.untied_head_bytes)} that folding the rotation untied "
            "from the embedding"
        )
    return table


def _engines_table(report: CheckpointReport) -> Table:
    from rich.table import Table

    engines = Table(title="Loads in (layers per kernel)")
    engines.add_column("engine")
    engines.add_column("all layers", justify="center")
    engines.add_column("kernels / types")
    for verdict in report.loads_in:
        engines.add_row(verdict.engine, "yes" if verdict.loads else "no", verdict.summary)
    engines.caption = f"vLLM kernels: predicted from vLLM {VLLM_VERSION} source (quantkit.format.engines), not loaded"
    return engines
