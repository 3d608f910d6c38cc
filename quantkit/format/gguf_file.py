"""What a GGUF file holds, read from its header: every tensor's type, shape and bytes, sums per type, and
bits per weight (all of a tensor's bytes: block scales and minimums counted), for ``quantkit inspect``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as QType
from rich.console import Group
from rich.table import Table

FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def tensor_nbytes(type_name: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of ``shape`` stored as ``type_name`` (a GGML type name, F16, BF16 or F32)."""
    n = math.prod(shape)
    if type_name in FLOAT_BYTES:
        return FLOAT_BYTES[type_name] * n
    block, size = gguf.GGML_QUANT_SIZES[QType[type_name]]
    return n // block * size


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    type: str
    shape: list[int]  # PyTorch order ([N, K])
    bytes: int

    @property
    def params(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class TypeSum:
    type: str
    tensors: int
    params: int
    bytes: int

    @property
    def bpw(self) -> float:
        return 8 * self.bytes / self.params if self.params else 0.0


@dataclass(slots=True)
class GGUFReport:
    path: str
    architecture: str
    file_type: str
    file_bytes: int
    tensors: list[GGUFTensorInfo] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(t.params for t in self.tensors)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def bpw(self) -> float:
        """Whole-file bits per weight: the file's bytes (metadata and vocabulary included) over all weights."""
        return 8 * self.file_bytes / self.params

    def by_type(self) -> list[TypeSum]:
        sums: dict[str, TypeSum] = {}
        for t in self.tensors:
            s = sums.setdefault(t.type, TypeSum(t.type, 0, 0, 0))
            s.tensors, s.params, s.bytes = s.tensors + 1, s.params + t.params, s.bytes + t.bytes
        return sorted(sums.values(), key=lambda s: -s.bytes)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "architecture": self.architecture,
            "file_type": self.file_type,
            "file_bytes": self.file_bytes,
            "params": self.params,
            "bpw": self.bpw,
            "tensor_bpw": 8 * self.tensor_bytes / self.params,
            "types": [asdict(s) | {"bpw": s.bpw} for s in self.by_type()],
            "tensors": [asdict(t) for t in self.tensors],
        }


def read_gguf_report(path: str | Path) -> GGUFReport:
    """The tensors of the GGUF file at ``path``, in file order."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else "?"
    ftype_field = reader.fields.get("general.file_type")
    file_type = "?"
    if ftype_field is not None:
        value = int(ftype_field.contents())
        file_type = next((f.name.removeprefix("MOSTLY_") for f in gguf.LlamaFileType if f.value == value), str(value))
    tensors = [
        GGUFTensorInfo(t.name, t.tensor_type.name, [int(n) for n in reversed(t.shape)], int(t.n_bytes))
        for t in reader.tensors
    ]
    return GGUFReport(str(path), str(arch), file_type, Path(path).stat().st_size, tensors)


def type_table(sums: Sequence[TypeSum], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("type", "tensors", "weights", "MB", "bpw"):
        table.add_column(column, justify="right" if column != "type" else "left")
    for s in sums:
        table.add_row(s.type, str(s.tensors), f"{s.params:,}", f"{s.bytes / 1e6:.2f}", f"{s.bpw:.3f}")
    return table


def render_gguf_report(report: GGUFReport, *, list_tensors: bool = True) -> Group:
    parts = []
    if list_tensors:
        table = Table(title=f"{report.path} ({report.architecture}, {report.file_type})", title_justify="left")
        for column in ("tensor", "type", "shape", "bytes", "bpw"):
            table.add_column(column, justify="left" if column in ("tensor", "type") else "right")
        for t in report.tensors:
            bpw = 8 * t.bytes / t.params if t.params else 0.0
            table.add_row(t.name, t.type, "x".join(map(str, t.shape)), f"{t.bytes:,}", f"{bpw:.3f}")
        parts.append(table)
    parts.append(type_table(report.by_type(), "Per type"))
    summary = Table(title="File", title_justify="left")
    for column in ("weights", "file MB", "bpw (whole file)", "bpw (tensors)"):
        summary.add_column(column, justify="right")
    summary.add_row(
        f"{report.params:,}",
        f"{report.file_bytes / 1e6:.2f}",
        f"{report.bpw:.3f}",
        f"{8 * report.tensor_bytes / report.params:.3f}",
    )
    parts.append(summary)
    return Group(*parts)
