"""A scratch file for activations that are written once and read back once, reused from block to block.

The file is opened once and overwritten in place for every block, not recreated: writing into pages the page
cache already holds is a plain copy, while a fresh file makes the filesystem allocate every page again. The
data lives in the page cache, not in the process's resident set. The file is removed by :meth:`SpillFile.close`.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import BinaryIO

import torch


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The storage of a contiguous CPU tensor as a writable byte view (any dtype, bfloat16 included)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


class SpillFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None
        self._written: list[tuple[torch.Size, torch.dtype]] = []  # since the last rewind, in order

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def written(self) -> list[tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of each tensor written since the last :meth:`rewind`."""
        return list(self._written)

    def rewind(self) -> None:
        """Start a new sequence: the next write goes to the start of the file, over the previous data."""
        self._written = []
        if self._file is not None:
            self._file.seek(0)

    def write(self, tensor: torch.Tensor) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w+b")  # noqa: SIM115 -- kept open across blocks, closed in close()
        self._file.write(raw_bytes(tensor.contiguous()))
        self._written.append((tensor.shape, tensor.dtype))

    def read_back(self) -> Generator[torch.Tensor]:
        """Yield the tensors written since the last :meth:`rewind`, in order; then rewind.

        Tensors of the same shape are read into one buffer: use each before asking for the next.
        """
        assert self._file is not None, "nothing was written"
        self._file.flush()
        self._file.seek(0)
        tensor: torch.Tensor | None = None
        try:
            for shape, dtype in self._written:
                if tensor is None or tensor.shape != shape or tensor.dtype != dtype:
                    tensor = torch.empty(shape, dtype=dtype)
                if self._file.readinto(raw_bytes(tensor)) != tensor.numel() * tensor.element_size():
                    raise OSError(f"spill file {self.path} is truncated")
                yield tensor
        finally:
            self.rewind()

    def close(self) -> None:
        """Close and delete the file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._written = []
        self.path.unlink(missing_ok=True)
