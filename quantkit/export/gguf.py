"""GGUF export: a quantkit checkpoint's integer codes written as llama.cpp blocks, never requantized.

Everything GGUF cannot hold exactly is refused before the file is opened (:func:`check_gguf`); then the header,
the metadata and the tensor infos are written, and the tensors one at a time. The parts: blocks from codes
(:mod:`quantkit.export.gguf_blocks`), the tensor plan (:mod:`quantkit.export.gguf_tensors`), hyperparameters
(:mod:`quantkit.export.gguf_metadata`) and the tokenizer (:mod:`quantkit.export.gguf_vocab`).
"""

from __future__ import annotations

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
from quantkit.export.gguf_blocks import permuted, q4_0_blocks, q4_1_blocks, q8_0_blocks
from quantkit.export.gguf_metadata import add_hparams, check_rope, file_type, llama_arch, model_name
from quantkit.export.gguf_tensors import Entry, dense_array, generated_tensors, info_args, plan_tensors, read_dense
from quantkit.export.gguf_vocab import Vocab, add_vocab, check_tokenizer, read_vocab
from quantkit.export.source import ExportSource, ExportSummary
from quantkit.format.engines import gguf_type
from quantkit.format.pack import unpack_int32
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import SCALE, ZERO

FP16_MAX = float(np.finfo(np.float16).max)


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


def check_gguf_model(model_dir: Path, config: dict[str, Any]) -> None:
    """What can be checked on the float model before quantizing: architecture, RoPE and tokenizer."""
    check_rope(llama_arch(config), config)
    check_tokenizer(Path(model_dir), None, config.get("vocab_size"))


def check_gguf(source: ExportSource, *, tokenizer_pre: str | None = None) -> None:
    """QuantkitError (one line: which layers or what, why, the fix) for anything GGUF cannot hold exactly."""
    arch = llama_arch(source.config)
    check_rope(arch, source.config)
    _check_schemes(source)
    _check_scales(source)
    check_tokenizer(source.path, tokenizer_pre, source.config.get("vocab_size"))
    plan_tensors(source, arch)


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
        return dense_array(entry, read_dense(entry))
    qw = permuted(qw, entry.permute_heads)
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
    writer.add_name(model_name(source.config, source.path))
    add_hparams(writer, arch, source.config)
    writer.add_file_type(file_type(plan))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, vocab, space_prefix_key=arch == gguf.MODEL_ARCH.LLAMA)
    for entry in plan:
        shape, dtype, raw = info_args(entry)
        writer.add_tensor_info(entry.name, shape, dtype, entry.nbytes, raw_dtype=raw)
    return writer


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
