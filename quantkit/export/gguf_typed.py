"""The typed GGUF writer: a float model's metadata and tokenizer, and tensors whose GGML bytes were solved already
(K-quants, legacy blocks, F16/F32), written as one llama.cpp file.

The quantizer (:mod:`quantkit.quantization.gguf`) solves every tensor in Hugging Face row order and hands this
writer each tensor's bytes; the writer applies llama.cpp's q/k row permutation (a pure reorder of whole rows, so
the blocks along a row are unchanged), adds the same ``{arch}.*`` keys and vocabulary as the code-exact exporter
(:mod:`quantkit.export.gguf_metadata`, :mod:`quantkit.export.gguf_vocab`) and streams the tensors one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from quantkit.export.gguf_blocks import head_permutation
from quantkit.export.gguf_metadata import add_hparams, check_rope, llama_arch, model_name
from quantkit.export.gguf_tensors import _permute_heads, generated_tensors
from quantkit.export.gguf_vocab import add_vocab, check_tokenizer, read_vocab
from quantkit.format.gguf_file import tensor_nbytes

# the ftype recorded for a per-tensor plan: the mix named after the type that holds the most weights
_FILE_TYPE_OF_TYPE = {
    "Q2_K": "MOSTLY_Q2_K",
    "Q3_K": "MOSTLY_Q3_K_M",
    "Q4_K": "MOSTLY_Q4_K_M",
    "Q5_K": "MOSTLY_Q5_K_M",
    "Q6_K": "MOSTLY_Q6_K",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
    "IQ4_NL": "MOSTLY_IQ4_NL",
}


class TypedTensor(Protocol):
    hf_name: str
    name: str  # GGUF name
    shape: tuple[int, ...]  # [N, K] or [K]

    @property
    def type(self) -> str: ...  # a GGML type name, "F16" or "F32"


def check_typed_model(model_dir: Path, config: dict[str, Any], tokenizer_pre: str | None = None) -> None:
    """Everything about the model itself that GGUF output needs (architecture, RoPE, tokenizer), before work."""
    check_rope(llama_arch(config), config)
    check_tokenizer(Path(model_dir), tokenizer_pre, config.get("vocab_size"))


def file_type_of(plan: Sequence[TypedTensor], file_type: gguf.LlamaFileType | None) -> gguf.LlamaFileType:
    if file_type is not None:
        return file_type
    counts: dict[str, int] = {}
    for t in plan:
        if t.type in _FILE_TYPE_OF_TYPE:
            counts[t.type] = counts.get(t.type, 0) + int(np.prod(t.shape))
    return gguf.LlamaFileType[_FILE_TYPE_OF_TYPE[max(counts, key=counts.__getitem__)]]


def _info(t: TypedTensor) -> tuple[tuple[int, ...], np.dtype, QType | None]:
    if t.type == "F32":
        return tuple(t.shape), np.dtype(np.float32), None
    if t.type == "F16":
        return tuple(t.shape), np.dtype(np.float16), None
    qtype = QType[t.type]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (*t.shape[:-1], t.shape[-1] // block * size), np.dtype(np.uint8), qtype


def _as_stored(t: TypedTensor, data: np.ndarray) -> np.ndarray:
    """``data`` (uint8 rows for a block type, or floats) as the writer stores it: F32/F16 as such."""
    if t.type == "F32":
        return np.ascontiguousarray(data, dtype=np.float32).reshape(t.shape)
    if t.type == "F16":
        return (
            np.ascontiguousarray(data).view(np.float16).reshape(t.shape)
            if data.dtype == np.uint8
            else (np.ascontiguousarray(data, dtype=np.float16).reshape(t.shape))
        )
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(_info(t)[0])


def write_typed_gguf(
    source: Path,
    plan: Sequence[TypedTensor],
    data_of: Callable[[TypedTensor], np.ndarray],
    out_file: Path,
    *,
    file_type: gguf.LlamaFileType | None = None,
    tokenizer_pre: str | None = None,
) -> int:
    """Write the model at ``source`` (config.json and tokenizer) with ``plan``'s tensors, each one's bytes from
    ``data_of`` in Hugging Face row order, into ``out_file`` (a temporary path the caller renames); returns bytes.
    """
    import json

    config = json.loads((Path(source) / "config.json").read_text())
    arch = llama_arch(config)
    vocab = read_vocab(Path(source), config, tokenizer_pre)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_name(config, Path(source)))
    add_hparams(writer, arch, config)
    writer.add_file_type(file_type_of(plan, file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, vocab, space_prefix_key=arch == gguf.MODEL_ARCH.LLAMA)
    extra = generated_tensors(config)  # Llama 3's rope_freqs
    for entry in extra:
        writer.add_tensor_info(entry.name, entry.shape, np.dtype(np.float32), entry.nbytes)
    for t in plan:
        shape, dtype, raw = _info(t)
        writer.add_tensor_info(t.name, shape, dtype, tensor_nbytes(t.type, t.shape), raw_dtype=raw)
    try:
        writer.write_header_to_file(path=Path(out_file))
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for entry in extra:
            writer.write_tensor_data(entry.generated)
        for t in plan:
            data = np.asarray(data_of(t))
            heads = _permute_heads(arch, config, t.hf_name)
            if heads is not None:
                data = data.reshape(t.shape[0], -1)[head_permutation(t.shape[0], heads).numpy()]
            stored = _as_stored(t, data)
            assert stored.nbytes == tensor_nbytes(t.type, t.shape), f"{t.name}: {stored.nbytes} bytes"
            writer.write_tensor_data(stored)
    finally:
        writer.close()
    return Path(out_file).stat().st_size
