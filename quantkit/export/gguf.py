"""GGUF export: a quantkit checkpoint's integer codes written as llama.cpp blocks, never requantized.

GGUF's 32-weight blocks hold one fp16 scale each, along the input dimension (ggml's ne0), the direction of
quantkit's groups:

- ``Q4_0`` (symmetric int4): ``d = scale``, nibble ``q + 8``; ``w = (nibble - 8) * d``, bit-exact.
- ``Q8_0`` (symmetric int8): ``d = scale``, ``q`` as is; ``w = q * d``, bit-exact.
- ``Q4_1`` (asymmetric int4): ``d = scale``, ``m = -scale * (zero + 8)`` rounded to fp16, nibble ``q + 8``;
  ``w = nibble * d + m`` differs from ``(q - zero) * scale`` where ``m``'s rounding shows (measured, in notes).

A group of 64 or 128 repeats its scale over its 32-blocks; per-channel repeats it along the row. Tensor names,
hyperparameter keys and the Q/K row permutation follow llama.cpp's convert_hf_to_gguf.py (conversion/base.py
``TextModel``, conversion/llama.py ``LlamaModel``, conversion/qwen.py ``Qwen2Model``/``Qwen3Model``); tensor
names come from gguf-py's own ``TensorNameMap``. Unquantized matrices keep their stored dtype (BF16, F16, F32);
1-D tensors and norms are F32, as the converter writes them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from safetensors import safe_open

from quantkit.errors import QuantkitError
from quantkit.export.gguf_vocab import Vocab, add_vocab, check_tokenizer, read_vocab
from quantkit.export.source import ExportSource, ExportSummary
from quantkit.format.engines import gguf_type
from quantkit.format.pack import unpack_int32
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import PACKED, QUANTIZED_PARTS, SCALE, ZERO

# HF architecture -> llama.cpp architecture (the converter's model classes registered for these names).
ARCHITECTURES: dict[str, gguf.MODEL_ARCH] = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
}
PERMUTED_ARCHS = {gguf.MODEL_ARCH.LLAMA}  # LlamaModel.undo_permute: q/k rows regrouped for llama.cpp's RoPE
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")
ROPE_TYPES = (None, "default", "linear", "yarn", "llama3")
QK = 32  # weights per block of Q4_0, Q4_1, Q8_0
FILE_TYPES = {
    QType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    QType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    QType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}
FP16_MAX = float(np.finfo(np.float16).max)


# --------------------------------------------------------------------------------------------------
# What GGUF can hold
# --------------------------------------------------------------------------------------------------


def block_type(scheme: QuantScheme, in_features: int) -> QType | None:
    """The GGUF block type that holds ``scheme``'s codes exactly (None: none does); the rule is
    :func:`quantkit.format.engines.gguf_type`."""
    support = gguf_type(scheme, in_features)
    return QType[support.kernel] if support.loads else None


def llama_arch(config: dict[str, Any]) -> gguf.MODEL_ARCH:
    names = config.get("architectures") or []
    name = names[0] if names else config.get("model_type", "unknown")
    if name not in ARCHITECTURES:
        raise QuantkitError(
            f"architecture {name} has no GGUF mapping here; GGUF export supports {', '.join(ARCHITECTURES)} "
            "(llama.cpp archs llama, qwen2, qwen3)"
        )
    return ARCHITECTURES[name]


# --------------------------------------------------------------------------------------------------
# The plan: every tensor's GGUF name, type and size, from safetensors metadata only
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Entry:
    """One GGUF tensor: where it comes from and what it becomes."""

    hf_name: str  # checkpoint name (a quantized Linear's prefix + ".weight")
    name: str  # GGUF name
    qtype: QType
    shape: tuple[int, ...]  # PyTorch order ([N, K] for a matrix)
    file: Path
    prefix: str | None = None  # quantized Linear prefix; None for a dense tensor
    permute_heads: int | None = None  # llama q/k: head count of the row permutation
    generated: np.ndarray | None = None  # a tensor the converter computes (Llama 3's rope_freqs)

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def _permute_heads(arch: gguf.MODEL_ARCH, config: dict[str, Any], hf_name: str) -> int | None:
    """The head count llama.cpp's converter permutes a q/k weight or bias with (None: not permuted)."""
    if arch not in PERMUTED_ARCHS:
        return None
    n_head = int(config["num_attention_heads"])
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return n_head
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return int(config.get("num_key_value_heads") or n_head)
    return None


def _dense_type(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> QType:
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return QType.F32
    return {torch.bfloat16: QType.BF16, torch.float16: QType.F16}.get(dtype, QType.F32)


def _tensor_names(source: ExportSource) -> Iterator[tuple[Path, str]]:
    for file in source.files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield file, key


def _checkpoint_tensors(source: ExportSource) -> Iterator[tuple[Path, str, str | None]]:
    """(file, HF tensor name, quantized Linear prefix or None) of every tensor to export, in checkpoint order.

    A quantized Linear appears once (as ``<prefix>.weight``, where its packed codes are); its bias is dense."""
    for file, key in _tensor_names(source):
        owner, _, suffix = key.rpartition(".")
        if owner in source.quantized and suffix in QUANTIZED_PARTS:
            if suffix == PACKED:
                yield file, f"{owner}.weight", owner
        elif not key.endswith(SKIPPED_SUFFIXES):
            yield file, key, None


def _shape_and_type(
    source: ExportSource, file: Path, hf_name: str, name: str, scheme: QuantScheme | None
) -> tuple[tuple[int, ...], QType]:
    if scheme is not None:
        shape = source.shapes[hf_name.removesuffix(".weight")]
        qtype = block_type(scheme, shape[1])
        assert qtype is not None, "check_gguf refuses schemes without a block type"
        return shape, qtype
    with safe_open(str(file), framework="pt") as handle:
        piece = handle.get_slice(hf_name)
        shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
    return shape, _dense_type(name, shape, _torch_dtype(dtype))


def plan_tensors(source: ExportSource, arch: gguf.MODEL_ARCH) -> list[Entry]:
    """Every GGUF tensor in checkpoint order; QuantkitError for a tensor llama.cpp has no name for."""
    names = gguf.get_tensor_name_map(arch, int(source.config["num_hidden_layers"]))
    schemes = source.scheme_of
    plan: list[Entry] = []
    for file, hf_name, prefix in _checkpoint_tensors(source):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise QuantkitError(
                f"{source.path}: tensor {hf_name} has no llama.cpp name for arch {gguf.MODEL_ARCH_NAMES[arch]}; "
                "GGUF export writes the standard decoder tensors only"
            )
        shape, qtype = _shape_and_type(source, file, hf_name, name, schemes[prefix] if prefix else None)
        heads = _permute_heads(arch, source.config, hf_name)
        plan.append(Entry(hf_name, name, qtype, shape, file, prefix, heads))
    return plan


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(dtype, torch.float32)


# --------------------------------------------------------------------------------------------------
# Checks (everything that can fail does so before the file is opened)
# --------------------------------------------------------------------------------------------------


def _layers_text(prefixes: list[str]) -> str:
    more = f" and {len(prefixes) - 1} more" if len(prefixes) > 1 else ""
    return f"{prefixes[0]}{more}"


def _check_schemes(source: ExportSource) -> None:
    refused: dict[str, list[str]] = {}
    for prefix, scheme in source.scheme_of.items():
        support = gguf_type(scheme, source.shapes[prefix][1])
        if not support.loads:
            refused.setdefault(f"{scheme.name}: {support.reason}", []).append(prefix)
    for reason, prefixes in refused.items():
        raise QuantkitError(
            f"GGUF cannot hold {reason} ({_layers_text(prefixes)}); quantize with 4-bit (symmetric: Q4_0, "
            "asymmetric: Q4_1) or symmetric 8-bit (Q8_0) codes, a group size that is a multiple of 32 (32, 64, 128) "
            "or per-channel, act-order only with static groups, or keep these layers in float (--ignore)"
        )


def _scale_and_zero(file: Path, prefix: str, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    with safe_open(str(file), framework="pt") as handle:
        scale = handle.get_tensor(f"{prefix}.{SCALE}").float()
        zero = None
        if not scheme.symmetric:
            zero = unpack_int32(handle.get_tensor(f"{prefix}.{ZERO}"), scheme.bits, scale.shape[0], dim=0)
    return scale, zero


def _fp16_misfits(scale: torch.Tensor, zero: torch.Tensor | None) -> int:
    """How many block scales (and Q4_1 minimums) fp16 cannot hold."""
    bad = ~torch.isfinite(scale) | (scale.half().float() != scale)
    if zero is not None:
        bad |= (scale * (zero.float() + 8)).abs() > FP16_MAX
    return int(bad.sum())


def _check_scales(source: ExportSource) -> None:
    schemes = source.scheme_of
    misfits = {p: n for p, f in source.quantized.items() if (n := _fp16_misfits(*_scale_and_zero(f, p, schemes[p])))}
    if misfits:
        prefixes = list(misfits)
        raise QuantkitError(
            f"{_layers_text(prefixes)}: {sum(misfits.values())} scales are not representable in fp16, which GGUF "
            "blocks store; quantize a float16 copy of the model, or keep these layers in float (--ignore)"
        )


def _check_rope(arch: gguf.MODEL_ARCH, config: dict[str, Any]) -> None:
    rope = _rope(config)
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in ROPE_TYPES or (kind == "llama3" and arch != gguf.MODEL_ARCH.LLAMA):
        raise QuantkitError(
            f"RoPE scaling type {kind!r} has no GGUF export here (supported: default, linear, yarn, llama3 for "
            "Llama); convert the float model with llama.cpp's convert_hf_to_gguf.py instead"
        )


def check_gguf_model(model_dir: Path, config: dict[str, Any]) -> None:
    """What can be checked on the float model before quantizing: architecture, RoPE and tokenizer."""
    _check_rope(llama_arch(config), config)
    check_tokenizer(Path(model_dir), None, config.get("vocab_size"))


def check_gguf(source: ExportSource, *, tokenizer_pre: str | None = None) -> None:
    """QuantkitError (one line: which layers or what, why, the fix) for anything GGUF cannot hold exactly."""
    arch = llama_arch(source.config)
    _check_rope(arch, source.config)
    _check_schemes(source)
    _check_scales(source)
    check_tokenizer(source.path, tokenizer_pre, source.config.get("vocab_size"))
    plan_tensors(source, arch)


# --------------------------------------------------------------------------------------------------
# Blocks, from integer codes
# --------------------------------------------------------------------------------------------------


def head_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Row order llama.cpp's converter gives q/k: within each head, the two rotary halves interleaved."""
    return torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).transpose(1, 2).reshape(rows)


def _permuted(qw: QuantizedWeight, n_head: int | None) -> QuantizedWeight:
    """Rows move with their codes, scales and zero points (groups run along K, so they move together)."""
    if n_head is None:
        return qw
    perm = head_permutation(qw.shape[0], n_head)
    zero = None if qw.zero is None else qw.zero[perm]
    return QuantizedWeight(qw.qweight[perm], qw.scale[perm], zero, qw.g_idx, qw.scheme)


def _block_columns(qw: QuantizedWeight, values: torch.Tensor) -> np.ndarray:
    """Per-group ``values`` [N, G] spread to one value per 32-block [N, K/32]."""
    groups = qw.column_groups()[::QK]
    return values[:, groups].numpy()


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """[N, B] -> [N, B, 2] little-endian fp16 bytes."""
    return values.astype("<f2").view(np.uint8).reshape(*values.shape, 2)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[N, B, 32] unsigned 4-bit codes -> [N, B, 16] bytes: weight j in the low nibble, j + 16 in the high."""
    return (codes[..., : QK // 2] | (codes[..., QK // 2 :] << 4)).astype(np.uint8)


def _blocked_codes(qw: QuantizedWeight, offset: int) -> np.ndarray:
    n, k = qw.shape
    return (qw.qweight.numpy().astype(np.int16) + offset).astype(np.uint8).reshape(n, k // QK, QK)


def q4_0_blocks(qw: QuantizedWeight) -> np.ndarray:
    """Symmetric int4 -> Q4_0 bytes [N, K/32 * 18]."""
    d = _fp16_bytes(_block_columns(qw, qw.scale))
    out = np.concatenate([d, _nibbles(_blocked_codes(qw, 8))], axis=-1)
    return out.reshape(qw.shape[0], -1)


def q8_0_blocks(qw: QuantizedWeight) -> np.ndarray:
    """Symmetric int8 -> Q8_0 bytes [N, K/32 * 34]."""
    n, k = qw.shape
    d = _fp16_bytes(_block_columns(qw, qw.scale))
    codes = qw.qweight.numpy().astype(np.int8).view(np.uint8).reshape(n, k // QK, QK)
    return np.concatenate([d, codes], axis=-1).reshape(n, -1)


def q4_1_minimum(qw: QuantizedWeight) -> torch.Tensor:
    """Q4_1's per-group offset ``m = -scale * (zero + 8)`` in fp16 (nibble = q + 8)."""
    assert qw.zero is not None
    return (-qw.scale * (qw.zero.float() + 8)).half()


def q4_1_blocks(qw: QuantizedWeight) -> tuple[np.ndarray, int]:
    """Asymmetric int4 -> Q4_1 bytes [N, K/32 * 20], and how many weights dequantize differently."""
    d = _block_columns(qw, qw.scale)
    m = _block_columns(qw, q4_1_minimum(qw).float())
    codes = _blocked_codes(qw, 8)
    out = np.concatenate([_fp16_bytes(d), _fp16_bytes(m), _nibbles(codes)], axis=-1).reshape(qw.shape[0], -1)
    # what a reader computes (fp32 multiply, then add), against the checkpoint's own dequantization
    got = d.astype(np.float16).astype(np.float32)[..., None] * codes.astype(np.float32) + m[..., None]
    want = qw.dequantize().numpy().reshape(codes.shape)
    return out, int((got.view(np.int32) != want.view(np.int32)).sum())


# --------------------------------------------------------------------------------------------------
# Dense tensors
# --------------------------------------------------------------------------------------------------


def _read_dense(entry: Entry) -> torch.Tensor:
    with safe_open(str(entry.file), framework="pt") as handle:
        tensor = handle.get_tensor(entry.hf_name)
    if entry.permute_heads is not None:
        tensor = tensor[head_permutation(tensor.shape[0], entry.permute_heads)]
    return tensor.contiguous()


def dense_array(entry: Entry, tensor: torch.Tensor) -> np.ndarray:
    """A float tensor as the array the writer stores: F32/F16 as such, BF16 as its raw bytes."""
    if entry.qtype == QType.BF16:
        return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    if entry.qtype == QType.F16:
        return tensor.to(torch.float16).numpy()
    return tensor.to(torch.float32).numpy()


def _info_args(entry: Entry) -> tuple[tuple[int, ...], np.dtype, QType | None]:
    """(shape, dtype, raw type) for ``GGUFWriter.add_tensor_info``: byte shapes for block and BF16 types."""
    if entry.qtype == QType.F32:
        return entry.shape, np.dtype(np.float32), None
    if entry.qtype == QType.F16:
        return entry.shape, np.dtype(np.float16), None
    block, size = gguf.GGML_QUANT_SIZES[entry.qtype]
    return (*entry.shape[:-1], entry.shape[-1] // block * size), np.dtype(np.uint8), entry.qtype


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta"))
    return rope


def _add_rope(writer: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])


def add_hparams(writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, config: dict[str, Any]) -> None:
    """The ``{arch}.*`` keys convert_hf_to_gguf.py writes for these architectures."""
    writer.add_block_count(int(config["num_hidden_layers"]))
    if (n_ctx := config.get("max_position_embeddings")) is not None:
        writer.add_context_length(int(n_ctx))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    n_head = int(config["num_attention_heads"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
    _add_rope(writer, _rope(config))
    if (eps := config.get("rms_norm_eps")) is not None:
        writer.add_layer_norm_rms_eps(float(eps))
    if (head_dim := config.get("head_dim")) is not None:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    if arch == gguf.MODEL_ARCH.LLAMA:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(int(config["vocab_size"]))
        writer.add_rope_dimension_count(int(head_dim or int(config["hidden_size"]) // n_head))


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    """Llama 3 RoPE: per-frequency divisors llama.cpp reads from ``rope_freqs.weight`` (None for other RoPE)."""
    rope = _rope(config)
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    factors = np.where(wavelen > old_ctx / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen < old_ctx / high, 1.0, factors).astype(np.float32)


def _model_name(source: ExportSource) -> str:
    name = source.config.get("_name_or_path") or source.config.get("_model_name_or_path") or source.path.name
    return Path(str(name)).name or source.path.name


def file_type(plan: list[Entry]) -> gguf.LlamaFileType:
    """general.file_type: the block type that holds the most quantized weights."""
    counts: Counter[QType] = Counter()
    for entry in plan:
        if entry.qtype in FILE_TYPES:
            counts[entry.qtype] += math.prod(entry.shape)
    return FILE_TYPES[counts.most_common(1)[0][0]]


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Exactness:
    """Q4_1 weights whose dequantized value differs from the checkpoint's, over all Q4_1 weights."""

    differing: int = 0
    total: int = 0

    def note(self) -> str | None:
        if not self.total:
            return None
        share = self.differing / self.total
        return (
            f"Q4_1: {share:.6%} of weights ({self.differing} of {self.total}) are not bit-exact after "
            "dequantization (m = -scale*(zero+8) rounded to fp16, measured as fp32 nibble*d + m); Q4_0 and "
            "Q8_0 are bit-exact"
        )


def _tensor_data(entry: Entry, qw: QuantizedWeight | None, exact: _Exactness) -> np.ndarray:
    if entry.generated is not None:
        return entry.generated
    if qw is None:
        return dense_array(entry, _read_dense(entry))
    qw = _permuted(qw, entry.permute_heads)
    if entry.qtype == QType.Q4_0:
        return q4_0_blocks(qw)
    if entry.qtype == QType.Q8_0:
        return q8_0_blocks(qw)
    data, differing = q4_1_blocks(qw)
    exact.differing += differing
    exact.total += qw.qweight.numel()
    return data


def _stream(source: ExportSource, plan: list[Entry], exact: _Exactness) -> Iterator[tuple[Entry, np.ndarray]]:
    """Each tensor's bytes in plan order, one tensor in memory at a time."""
    quantized = source.quantized_weights()  # same order as the plan's quantized entries
    for entry in plan:
        qw = None
        if entry.prefix is not None:
            prefix, qw = next(quantized)
            assert prefix == entry.prefix, f"checkpoint order changed: {prefix} != {entry.prefix}"
        data = _tensor_data(entry, qw, exact)
        assert data.nbytes == entry.nbytes, f"{entry.name}: {data.nbytes} bytes, planned {entry.nbytes}"
        yield entry, data


def _writer(source: ExportSource, arch: gguf.MODEL_ARCH, plan: list[Entry], vocab: Vocab) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(_model_name(source))
    add_hparams(writer, arch, source.config)
    writer.add_file_type(file_type(plan))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, vocab, space_prefix_key=arch == gguf.MODEL_ARCH.LLAMA)
    for entry in plan:
        shape, dtype, raw = _info_args(entry)
        writer.add_tensor_info(entry.name, shape, dtype, entry.nbytes, raw_dtype=raw)
    return writer


def generated_tensors(config: dict[str, Any]) -> list[Entry]:
    """Tensors the converter computes rather than copies (``LlamaModel.generate_extra_tensors``)."""
    factors = llama3_rope_factors(config)
    if factors is None:
        return []
    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    return [Entry(name, name, QType.F32, factors.shape, Path(), generated=factors)]


def write_gguf(source: ExportSource, out_file: Path, *, tokenizer_pre: str | None = None) -> ExportSummary:
    """Write ``source`` as one GGUF file at ``out_file`` (a temporary path the caller renames).

    ``tokenizer_pre`` names llama.cpp's pre-tokenizer when tokenizer.json's is not one this exporter can tell.
    """
    check_gguf(source, tokenizer_pre=tokenizer_pre)
    out_file = Path(out_file)
    arch = llama_arch(source.config)
    plan = generated_tensors(source.config) + plan_tensors(source, arch)
    vocab = read_vocab(source.path, source.config, tokenizer_pre)
    writer = _writer(source, arch, plan, vocab)
    exact = _Exactness()
    try:
        writer.write_header_to_file(path=out_file)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, data in _stream(source, plan, exact):
            writer.write_tensor_data(data)
    except BaseException:
        writer.close()
        out_file.unlink(missing_ok=True)
        raise
    writer.close()
    notes = [*vocab.notes, f"general.file_type = {file_type(plan).name}"]
    if (note := exact.note()) is not None:
        notes.append(note)
    return ExportSummary(
        format="gguf",
        output=str(out_file),
        bytes=out_file.stat().st_size,
        tensor_types=dict(Counter(entry.qtype.name for entry in plan)),
        notes=notes,
    )
