"""GPTQ v1 export: a quantkit checkpoint's integer codes rewritten in the layout GPTQ stacks load (GPTQModel and
transformers + optimum load it, checked by ``tools/check_gptq_export.py``; the config follows what vLLM's
``gptq``/``gptq_marlin`` and AutoGPTQ read). Nothing is requantized.

Tensors of one quantized Linear (N out, K in, G = K / group_size groups, b bits, b in 2/4/8):

- ``qweight``  int32 [K*b/32, N]  unsigned codes ``q + 2**(b-1)`` packed along K, lowest bits first
- ``qzeros``   int32 [G, N*b/32]  zero points packed along N; v1 stores ``zero - 1``: ``2**(b-1) - 1`` when symmetric
- ``scales``   fp16  [G, N]
- ``g_idx``    int32 [K]          ``k // group_size``
- ``bias``     kept as stored

A GPTQ v1 weight dequantizes as ``(unpacked qweight - (qzeros + 1)) * scales[g_idx]``, which equals quantkit's
``q * scale`` exactly when every scale is representable in fp16 (checked). Mixed plans keep the most common scheme
as the base and override the others with GPTQModel's ``dynamic`` rules (``+:regex`` -> bits/group_size,
``-:regex`` -> left in float), which GPTQModel, vLLM and SGLang read with ``re.match``, first match wins.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import safe_open

from quantkit import __version__
from quantkit.errors import QuantkitError
from quantkit.export.source import ExportSource, ExportSummary
from quantkit.format.engines import gptq_support
from quantkit.format.files import side_files
from quantkit.format.pack import pack_int32
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import SCALE
from quantkit.format.writer import ShardedWriter

DEFAULT_MAX_SHARD_BYTES = 1024 * 1_000_000  # one shard is held in memory while it is written
QUANTIZE_CONFIG = "quantize_config.json"  # AutoGPTQ reads only this file; vLLM and GPTQModel fall back to it
# vLLM loads these HF linears as one fused matrix named by the key; a dynamic rule must match that name too
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_IN_LAYER = re.compile(r"^(?P<stack>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")  # model.layers . 3 . mlp.down_proj
_DTYPE_LABELS = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


# --------------------------------------------------------------------------------------------------
# Checks: everything GPTQ v1 cannot hold exactly is refused before anything is written
# --------------------------------------------------------------------------------------------------


def check_gptq(source: ExportSource) -> None:
    """QuantkitError (one line: layers, scheme, why, fix) for anything a GPTQ v1 export cannot hold exactly."""
    schemes = source.scheme_of
    shapes, inexact = _read_shapes_and_scales(source)
    refused = {p: v.reason for p, (_, k) in shapes.items() if not (v := gptq_support(schemes[p], k)).loads}
    if refused:
        fix = "re-quantize with a symmetric 2, 4 or 8-bit scheme, static groups and a group size dividing K"
        _raise(list(refused), schemes, f"cannot be held: {next(iter(refused.values()))}", fix)
    unpackable = {p: why for p, (n, k) in shapes.items() if (why := _word_problem(schemes[p], n, k))}
    if unpackable:
        _raise(list(unpackable), schemes, next(iter(unpackable.values())), "keep them in float (--ignore)")
    if inexact:
        total = sum(n * schemes[p].num_groups(k) for p, (n, k) in shapes.items())
        worst = max(inexact, key=inexact.__getitem__)
        why = (
            f"have {sum(inexact.values())} of {total} scales that float16 cannot represent exactly "
            f"({inexact[worst]} in {worst}); GPTQ stores scales as float16"
        )
        _raise(list(inexact), schemes, why, "quantize a float16 or bfloat16 copy of the model (scales keep its dtype)")


def _raise(layers: list[str], schemes: dict[str, QuantScheme], why: str, fix: str) -> NoReturn:
    names = ", ".join(sorted({schemes[p].name for p in layers}))
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    raise QuantkitError(f"cannot export to GPTQ: {len(layers)} layers ({shown}; scheme {names}) {why}; {fix}")


def _word_problem(scheme: QuantScheme, n: int, k: int) -> str | None:
    per_word = 32 // scheme.bits
    if k % per_word or n % per_word:
        return f"have a shape [{n}, {k}] whose sides are not multiples of {per_word}, so int32 words cannot hold them"
    return None


def _read_shapes_and_scales(source: ExportSource) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(N, K) of every quantized Linear, and per layer the count of scales float16 does not hold exactly."""
    inexact: dict[str, int] = {}
    for prefix, file in source.quantized.items():
        with safe_open(str(file), framework="pt") as handle:
            scale = handle.get_tensor(f"{prefix}.{SCALE}").float()
        bad = int((scale.to(torch.float16).float() != scale).sum())  # NaN counts as inexact
        if bad:
            inexact[prefix] = bad
    return source.shapes, inexact


# --------------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------------


def gptq_linear_tensors(prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of one symmetric quantized Linear (checked by :func:`check_gptq`)."""
    bits = qw.scheme.bits
    n, k = qw.shape
    groups = qw.scheme.num_groups(k)
    # quantkit packs q + 2**(b-1) as a little-endian bit stream along K; with b dividing 32 every code stays
    # inside one word, so word w of a row holds codes w*32/b .. (w+1)*32/b - 1, lowest first: GPTQ's layout, transposed
    qweight = pack_int32(qw.qweight, bits, dim=1).t().contiguous()
    return {
        f"{prefix}.qweight": qweight,
        f"{prefix}.qzeros": torch.full((groups, n * bits // 32), symmetric_qzeros_word(bits), dtype=torch.int32),
        f"{prefix}.scales": qw.scale.t().to(torch.float16).contiguous(),
        f"{prefix}.g_idx": (torch.arange(k) // qw.scheme.group_len(k)).to(torch.int32),
    }


def symmetric_qzeros_word(bits: int) -> int:
    """One int32 word of v1 zero points for a symmetric scheme: every field holds ``2**(b-1) - 1`` (zero - 1)."""
    stored = 2 ** (bits - 1) - 1
    return sum(stored << (bits * i) for i in range(32 // bits))  # top bit clear: fits a signed int32


def _float_block_linears(source: ExportSource) -> list[str]:
    """Linears of the decoder layers kept in float: 2-D ``.weight`` tensors in the layer stacks of quantized ones."""
    stacks = {m["stack"] for p in source.quantized if (m := _IN_LAYER.match(p))}
    found: list[str] = []
    for file in source.files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                module, _, leaf = key.rpartition(".")
                m = _IN_LAYER.match(module)
                if leaf != "weight" or module in source.quantized or m is None or m["stack"] not in stacks:
                    continue
                if len(handle.get_slice(key).get_shape()) == 2:
                    found.append(module)
    return found


# --------------------------------------------------------------------------------------------------
# quantization_config
# --------------------------------------------------------------------------------------------------


def scheme_label(scheme: QuantScheme) -> str:
    """``int4-g64``, ``int8-ch``: the stored type of a GPTQ linear."""
    return f"int{scheme.bits}-" + ("ch" if scheme.per_channel else f"g{scheme.group_size}")


def base_scheme(schemes: dict[str, QuantScheme]) -> QuantScheme:
    """The most common scheme (by layer count; the first seen wins a tie)."""
    return Counter(schemes.values()).most_common(1)[0][0]


def gptq_quantization_config(schemes: dict[str, QuantScheme], float_linears: Iterable[str] = ()) -> dict[str, Any]:
    """``quantization_config`` (and ``quantize_config.json``) of the export; ``dynamic`` only when needed."""
    base = base_scheme(schemes)
    float_linears = list(float_linears)
    config: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": base.bits,
        "group_size": base.group_size,
        "desc_act": False,
        "sym": True,
        "lm_head": False,
        "format": "gptq",  # GPTQModel's field
        "checkpoint_format": "gptq",  # the legacy name vLLM and transformers read: v1 zero points
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"quantkit:{__version__}"]},
    }
    dynamic = dynamic_rules(schemes, base, float_linears)
    if dynamic:
        config["dynamic"] = dynamic
    if float_linears:  # transformers/optimum ignore `dynamic`; they skip block linears missing from this list
        config["modules_in_block_to_quantize"] = [list(schemes)]
    return config


def dynamic_rules(
    schemes: dict[str, QuantScheme], base: QuantScheme, float_linears: Iterable[str] = ()
) -> dict[str, dict[str, int]]:
    """GPTQModel ``dynamic`` overrides: ``+:regex`` -> bits/group_size for each non-base scheme, ``-:regex`` -> {}
    for block linears kept in float. Each regex matches exactly its modules (and vLLM's fused names of them), so
    the rules are disjoint and their order (config.json sorts keys) does not matter."""
    rules: dict[str, dict[str, int]] = {}
    for pattern in module_patterns(list(float_linears)):
        rules[f"-:{pattern}"] = {}
    others = sorted({s for s in schemes.values() if s != base}, key=lambda s: (s.bits, s.group_size))
    for scheme in others:
        for pattern in module_patterns([p for p, s in schemes.items() if s == scheme]):
            rules[f"+:{pattern}"] = {"bits": scheme.bits, "group_size": scheme.group_size}
    return rules


def module_patterns(names: list[str]) -> list[str]:
    """Regexes (for ``re.match``, anchored at the end) that match exactly ``names``, plus vLLM's fused name of a
    fused group whose members are all listed; layers with the same members share one pattern."""
    singles: list[str] = []
    members: dict[tuple[str, str], dict[int, set[str]]] = {}  # (stack, parent in layer) -> layer -> leaves
    for name in names:
        m = _IN_LAYER.match(name)
        if m is None:
            singles.append(re.escape(name) + "$")
            continue
        parent, _, leaf = m["rest"].rpartition(".")
        members.setdefault((m["stack"], parent), {}).setdefault(int(m["index"]), set()).add(leaf)
    patterns = list(singles)
    for (stack, parent), by_layer in members.items():
        layers_of: dict[tuple[str, ...], list[int]] = {}
        for index, leaves in sorted(by_layer.items()):
            layers_of.setdefault(_with_fused(leaves), []).append(index)
        inner = re.escape(parent) + r"\." if parent else ""
        for leaves, indices in layers_of.items():
            patterns.append(rf"{re.escape(stack)}\.{_alternatives(map(str, indices))}\.{inner}{_alternatives(leaves)}$")
    return patterns


def _with_fused(leaves: set[str]) -> tuple[str, ...]:
    fused = {name for name, parts in VLLM_FUSED.items() if set(parts) <= leaves}
    return tuple(sorted(leaves | fused))


def _alternatives(items: Iterable[str]) -> str:
    escaped = [re.escape(item) for item in items]
    return escaped[0] if len(escaped) == 1 else "(?:" + "|".join(escaped) + ")"


# --------------------------------------------------------------------------------------------------
# The export
# --------------------------------------------------------------------------------------------------


def write_gptq(source: ExportSource, out_dir: Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ExportSummary:
    """Write ``source`` as a GPTQ v1 checkpoint into ``out_dir`` (a fresh empty directory the caller made).

    Checks everything first (:func:`check_gptq`); then one Linear at a time: codes repacked, scales as fp16.
    Dense tensors (embeddings, norms, the head, biases) keep their stored dtype.
    """
    check_gptq(source)
    out_dir = Path(out_dir)
    schemes = source.scheme_of
    float_linears = _float_block_linears(source)
    quant_config = gptq_quantization_config(schemes, float_linears)
    types: Counter[str] = Counter()
    dense_dtypes: set[torch.dtype] = set()
    # ShardedWriter builds a sibling directory and swaps it in for the (empty) out_dir once complete
    with ShardedWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=True) as writer:
        for prefix, qw in source.quantized_weights():
            writer.add(gptq_linear_tensors(prefix, qw))
            types[scheme_label(qw.scheme)] += 1
        for name, tensor in source.dense_tensors():
            writer.add({name: tensor})
            types[_dtype_label(tensor.dtype)] += 1
            dense_dtypes.add(tensor.dtype)
        writer.finalize(_config_without_quantization(source), side_files(source.path), quant_config)
    (out_dir / QUANTIZE_CONFIG).write_text(json.dumps(quant_config, indent=2) + "\n")
    return ExportSummary(
        format="gptq",
        output=str(out_dir),
        bytes=sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file()),
        tensor_types=dict(types),
        notes=_notes(schemes, float_linears, dense_dtypes),
    )


def _config_without_quantization(source: ExportSource) -> dict[str, Any]:
    return {k: v for k, v in source.config.items() if k != "quantization_config"}


def _dtype_label(dtype: torch.dtype) -> str:
    return _DTYPE_LABELS.get(dtype, str(dtype).removeprefix("torch.").upper())


def _notes(schemes: dict[str, QuantScheme], float_linears: list[str], dense_dtypes: set[torch.dtype]) -> list[str]:
    base = base_scheme(schemes)
    notes = [
        f"{len(schemes)} linears as GPTQ v1 (sym, desc_act false, fp16 scales): integer codes copied, bit-exact",
    ]
    overridden = sum(1 for s in schemes.values() if s != base)
    if overridden:
        notes.append(
            f"mixed plan: base {scheme_label(base)}, {overridden} linears overridden by `dynamic` rules, which "
            "GPTQModel, vLLM and SGLang read; transformers + optimum ignore them and would decode those linears "
            "with the base bits without an error: load this export with GPTQModel or vLLM"
        )
    if float_linears:
        notes.append(f"{len(float_linears)} decoder linears stay in float (`-:` dynamic rules)")
    if torch.bfloat16 in dense_dtypes:
        notes.append(
            "dense tensors kept in bfloat16 as stored; vLLM's `gptq` kernel needs --dtype float16 (gptq_marlin "
            "runs bfloat16)"
        )
    return notes
