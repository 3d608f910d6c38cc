"""The GGUF tensor plan: every tensor's llama.cpp name, block or float type and size, from safetensors headers,
and the float tensors' data as the writer stores it.

Tensor names come from gguf-py's own ``TensorNameMap``; the q/k row permutation follows llama.cpp's
convert_hf_to_gguf.py (conversion/llama.py ``LlamaModel.undo_permute``). Unquantized matrices keep their stored
dtype (BF16, F16, F32); 1-D tensors and norms are F32, as the converter writes them.
"""

from __future__ import annotations

import math
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
from quantkit.export.gguf_blocks import head_permutation
from quantkit.export.gguf_metadata import llama3_rope_factors
from quantkit.export.source import ExportSource
from quantkit.format.engines import gguf_type
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import PACKED, QUANTIZED_PARTS

PERMUTED_ARCHS = {gguf.MODEL_ARCH.LLAMA}  # LlamaModel.undo_permute: q/k rows regrouped for llama.cpp's RoPE
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


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


def block_type(scheme: QuantScheme, in_features: int) -> QType | None:
    """The GGUF block type that holds ``scheme``'s codes exactly (None: none does); the rule is
    :func:`quantkit.format.engines.gguf_type`."""
    support = gguf_type(scheme, in_features)
    return QType[support.kernel] if support.loads else None


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
    return shape, _dense_type(name, shape, _TORCH_DTYPES.get(dtype, torch.float32))


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


def generated_tensors(config: dict[str, Any]) -> list[Entry]:
    """Tensors the converter computes rather than copies (``LlamaModel.generate_extra_tensors``)."""
    factors = llama3_rope_factors(config)
    if factors is None:
        return []
    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    return [Entry(name, name, QType.F32, factors.shape, Path(), generated=factors)]


def read_dense(entry: Entry) -> torch.Tensor:
    """A float tensor from the checkpoint, its rows in llama.cpp's order."""
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


def info_args(entry: Entry) -> tuple[tuple[int, ...], np.dtype, QType | None]:
    """(shape, dtype, raw type) for ``GGUFWriter.add_tensor_info``: byte shapes for block and BF16 types."""
    if entry.qtype == QType.F32:
        return entry.shape, np.dtype(np.float32), None
    if entry.qtype == QType.F16:
        return entry.shape, np.dtype(np.float16), None
    block, size = gguf.GGML_QUANT_SIZES[entry.qtype]
    return (*entry.shape[:-1], entry.shape[-1] // block * size), np.dtype(np.uint8), entry.qtype
