"""The checkpoint an export reads: a quantkit ``pack-quantized`` directory, walked one tensor at a time.

Exports convert the stored integer codes; they never requantize. Quantized Linears come out as
:class:`QuantizedWeight` (codes, scales exactly as stored, zero points, g_idx); every other tensor
(embeddings, norms, an unquantized head) as the float tensor in its stored dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from quantkit.errors import QuantkitError
from quantkit.format.files import RUN_LOG, read_checkpoint_config, shard_files
from quantkit.format.quantization_config import QuantizationLayout, parse_quantization_config
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import PACKED, QUANTIZED_PARTS, SCALE, SHAPE, read_linear


@dataclass(slots=True)
class ExportSource:
    """A quantized checkpoint opened for export: its config, layout and files (tensors read lazily)."""

    path: Path
    config: dict[str, Any]
    layout: QuantizationLayout
    files: list[Path]
    quantized: dict[str, Path]  # Linear prefix -> shard that holds its tensors
    shapes: dict[str, tuple[int, int]]  # Linear prefix -> (out, in) features, from its weight_shape

    @property
    def scheme_of(self) -> dict[str, QuantScheme]:
        """Every quantized Linear's scheme, by prefix (``model.layers.0.self_attn.q_proj``)."""
        return {prefix: self._scheme(prefix) for prefix in self.quantized}

    def _scheme(self, prefix: str) -> QuantScheme:
        scheme = self.layout.scheme_for(prefix)
        if scheme is None:
            raise QuantkitError(f"{self.path}: {prefix} is packed but quantization_config gives it no scheme")
        return scheme

    def quantized_weights(self) -> Iterator[tuple[str, QuantizedWeight]]:
        """(prefix, integer weight) of every quantized Linear, in checkpoint order, one at a time."""
        for prefix, file in self.quantized.items():
            with safe_open(str(file), framework="pt") as handle:
                keys = [k for k in handle.keys() if k.rpartition(".")[0] == prefix]  # noqa: SIM118
                tensors = {k: handle.get_tensor(k) for k in keys}
            yield prefix, read_linear(tensors, prefix, self._scheme(prefix))

    def scale_dtype(self, prefix: str) -> torch.dtype:
        with safe_open(str(self.quantized[prefix]), framework="pt") as handle:
            return handle.get_slice(f"{prefix}.{SCALE}").get_dtype()

    def dense_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every tensor that is not a quantized weight's part (biases of quantized Linears
        included), in its stored dtype."""
        for file in self.files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    owner, _, part = key.rpartition(".")
                    if owner not in self.quantized or part not in QUANTIZED_PARTS:
                        yield key, handle.get_tensor(key)


def open_export_source(path: Path) -> ExportSource:
    """Open a checkpoint quantkit wrote; QuantkitError (one line, with the fix) for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise QuantkitError(f"{path} is not a directory; give the checkpoint directory `quantkit quantize` wrote")
    config = read_checkpoint_config(path)
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise QuantkitError(f"{path} is not a quantized checkpoint (config.json has no quantization_config)")
    if not (path / RUN_LOG).is_file():
        raise QuantkitError(
            f"{path} was not written by quantkit (no {RUN_LOG}); export reads only checkpoints from "
            "`quantkit quantize`, whose integer codes it converts without requantizing"
        )
    layout = parse_quantization_config(qc)
    files = shard_files(path)
    quantized: dict[str, Path] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("." + PACKED):
                    prefix = key.removesuffix("." + PACKED)
                    quantized[prefix] = file
                    n, k = handle.get_tensor(f"{prefix}.{SHAPE}").tolist()
                    shapes[prefix] = (int(n), int(k))
    if not quantized:
        raise QuantkitError(f"{path} holds no packed weights; it is not a quantized checkpoint")
    return ExportSource(path=path, config=config, layout=layout, files=files, quantized=quantized, shapes=shapes)


@dataclass(slots=True)
class ExportSummary:
    """What an export wrote, for the CLI's table and ``--json``."""

    format: str  # "gptq" or "gguf"
    output: str
    bytes: int
    tensor_types: dict[str, int]  # stored type (e.g. "int4-g64", "Q4_0", "F16") -> tensor count
    notes: list[str]  # facts a user should know (e.g. the share of Q4_1 weights that are not bit-exact)
