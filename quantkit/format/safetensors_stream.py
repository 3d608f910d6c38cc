"""Safetensors files written tensor by tensor, byte for byte what ``safetensors.torch.save_file`` writes, from
tensors in memory or from byte ranges of other safetensors files, which are copied in chunks and never loaded.

``save_file`` needs every tensor of a file in memory at once: a checkpoint shard is held whole, and a 128k-row
embedding copied from the source model is read (mapped) and cloned first. Here a :class:`StoredTensor` names where
a tensor's bytes are, and :func:`write_safetensors` streams them.

The layout (the public safetensors format, as the library lays it out; tests compare with ``save_file``): an
8-byte little-endian header length, a compact JSON header (``__metadata__`` first, then each tensor's dtype, shape
and data offsets, in data order) padded with spaces to a multiple of 8, then the data. Data order: by dtype, in the
order the library sorts them (read off the library itself, once), then by name.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

_CHUNK = 16 << 20  # bytes per copy step
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}

TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor's bytes inside a safetensors file (absolute offsets), its safetensors dtype name and shape."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def write_to(self, out: BinaryIO) -> None:
        """Copy the bytes into ``out`` a chunk at a time (through the page cache, not this process's memory)."""
        buffer = bytearray(min(_CHUNK, self.nbytes))
        with open(self.path, "rb") as source:
            source.seek(self.start)
            left = self.nbytes
            while left:
                view = memoryview(buffer)[: min(left, len(buffer))]
                if source.readinto(view) != len(view):
                    raise OSError(f"{self.path} ends inside tensor data (bytes {self.start}..{self.end})")
                out.write(view)
                left -= len(view)

    def read_values(self) -> list[int | float]:
        """The elements of a small tensor (a linear's ``weight_shape``), read from the file."""
        if self.dtype not in TORCH_DTYPES or not self.nbytes:
            raise ValueError(f"values of a non-empty tensor of a known dtype, not {self.dtype} {self.shape}")
        with open(self.path, "rb") as source:
            source.seek(self.start)
            data = bytearray(source.read(self.nbytes))
        if len(data) != self.nbytes:
            raise OSError(f"{self.path} ends inside tensor data (bytes {self.start}..{self.end})")
        return torch.frombuffer(data, dtype=TORCH_DTYPES[self.dtype]).tolist()

    def read_rows(self, rows: list[int]) -> torch.Tensor:
        """Rows ``rows`` of a 2-D tensor as a [len(rows), width] tensor, each read on its own (never the whole)."""
        if len(self.shape) != 2 or self.dtype not in TORCH_DTYPES:
            raise ValueError(f"rows of a 2-D tensor of a known dtype, not {self.dtype} {self.shape}")
        out = torch.empty(len(rows), self.shape[1], dtype=TORCH_DTYPES[self.dtype])
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        with open(self.path, "rb") as source:
            for i, row in enumerate(rows):
                source.seek(self.start + row * row_bytes)
                if source.readinto(view[i * row_bytes : (i + 1) * row_bytes]) != row_bytes:
                    raise OSError(f"{self.path} ends inside tensor data (row {row})")
        return out


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file, by name in the order ``safe_open(...).keys()`` gives (sorted)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    header.pop("__metadata__", None)
    return {
        name: StoredTensor(
            Path(path),
            info["dtype"],
            tuple(info["shape"]),
            base + info["data_offsets"][0],
            base + info["data_offsets"][1],
        )
        for name, info in sorted(header.items())
    }


def _spec(tensor: torch.Tensor | StoredTensor) -> tuple[str, tuple[int, ...], int]:
    if isinstance(tensor, StoredTensor):
        return tensor.dtype, tensor.shape, tensor.nbytes
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"cannot write dtype {tensor.dtype} to safetensors here")
    return DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), tensor.numel() * tensor.element_size()


@functools.cache
def _dtype_rank() -> dict[str, int]:
    """Where the safetensors library puts each dtype in a file's data (0 first), read from a file it writes."""
    from safetensors.torch import save

    probe = {name: torch.zeros(1, dtype=dtype) for dtype, name in DTYPE_NAMES.items()}
    data = save(probe)
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    order = sorted(header, key=lambda name: header[name]["data_offsets"][0])
    return {name: rank for rank, name in enumerate(order)}


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor | StoredTensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (CPU tensors, or stored ranges of other files) to ``path``, as ``save_file`` would."""
    specs = {name: _spec(t) for name, t in tensors.items()}
    rank = _dtype_rank()
    order = sorted(specs, key=lambda name: (rank[specs[name][0]], name))
    header: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        dtype, shape, nbytes = specs[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name in order:
            tensor = tensors[name]
            if isinstance(tensor, StoredTensor):
                tensor.write_to(out)
            elif tensor.numel():
                out.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
