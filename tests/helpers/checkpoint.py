"""A ``pack-quantized`` checkpoint from an in-memory model whose Linears a test quantized, written with the package's
own writer (:class:`ShardedWriter`) and tensor layout (:func:`linear_tensors`). The quantizer writes from files,
block by block (``write_checkpoint``); tests build their small models in memory."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from quantkit.format.files import shard_files
from quantkit.format.scheme import QuantizedWeight
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter


def save_quantized_model(
    model: torch.nn.Module,
    quantized: Mapping[str, QuantizedWeight],
    quantization_config: Mapping[str, Any],
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """``model`` with the Linears named in ``quantized`` stored packed; float tensors and scales in ``dtype``, a tied
    weight once (under its first name)."""
    config = model.config.to_dict()
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)
    skip = {f"{name}.weight" for name in quantized}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    with ShardedWriter(out_dir, max_shard_bytes=max_shard_bytes) as writer:
        for key, tensor in model.state_dict().items():
            ident = (tensor.data_ptr(), tuple(tensor.shape))
            if key in skip or (ident in seen and tensor.numel()):
                continue
            seen.add(ident)
            writer.add({key: tensor.to(dtype) if tensor.is_floating_point() else tensor})
        for name, qw in quantized.items():
            writer.add(linear_tensors(name, qw, dtype))
        return writer.finalize(config, (), quantization_config)


def data_bytes(path: Path) -> int:
    """The safetensors data bytes of a checkpoint: each shard's size less its 8-byte length and JSON header."""
    total = 0
    for shard in shard_files(path):
        with open(shard, "rb") as handle:
            (header,) = struct.unpack("<Q", handle.read(8))
        total += shard.stat().st_size - 8 - header
    return total
