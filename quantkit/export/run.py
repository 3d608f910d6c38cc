"""``quantkit export``: one quantized checkpoint into another stack's format, checked in full before anything is
written, written under a temporary name, flushed and renamed into place (nothing under the output name otherwise).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantkit.atomic import publish, remove_path
from quantkit.errors import QuantkitError
from quantkit.export.source import ExportSource, ExportSummary, open_export_source
from quantkit.format.engines import EXPORT_SUPPORT

COMPRESSED_TENSORS = "compressed-tensors"  # what `quantize` writes; the exports below are made from it
GPTQ, GGUF = "gptq", "gguf"
EXPORT_FORMATS = tuple(EXPORT_SUPPORT)
OUTPUT_FORMATS = (COMPRESSED_TENSORS, *EXPORT_FORMATS)


@dataclass(frozen=True, slots=True)
class Exporter:
    check: Callable[[ExportSource], None]  # QuantkitError for anything the format cannot hold exactly
    write: Callable[[ExportSource, Path], ExportSummary]  # into a temporary path (a directory or a file)
    is_file: bool  # GGUF is one file; GPTQ an HF directory


def _exporter(fmt: str) -> Exporter:
    if fmt == GPTQ:
        from quantkit.export.gptq import check_gptq, write_gptq

        return Exporter(check_gptq, write_gptq, is_file=False)
    if fmt == GGUF:
        from quantkit.export.gguf import check_gguf, write_gguf

        return Exporter(check_gguf, write_gguf, is_file=True)
    raise QuantkitError(f"unknown export format '{fmt}'; use one of {', '.join(EXPORT_FORMATS)}")


def check_exports_of_model(model_dir: Path, formats: list[str]) -> None:
    """Before quantizing: what the exports need of the model itself (layer schemes are checked by ``quantize``)."""
    if GGUF in formats:
        from quantkit.export.gguf import check_gguf_model

        check_gguf_model(model_dir, json.loads((Path(model_dir) / "config.json").read_text()))


def default_export_path(checkpoint: Path, fmt: str) -> Path:
    """Where ``quantize --format`` and recipes put an export: ``<out>-gptq/`` or ``<out>.gguf`` beside ``<out>``."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(f"{checkpoint.name}.gguf" if fmt == GGUF else f"{checkpoint.name}-{fmt}")


def export_checkpoint(checkpoint: Path, fmt: str, output: Path, *, force: bool = False) -> ExportSummary:
    """Convert ``checkpoint`` (written by ``quantkit quantize``) to ``fmt`` at ``output`` from its integer codes."""
    exporter = _exporter(fmt)
    output = Path(output)
    if output.exists() and not force:
        raise QuantkitError(f"{output} exists; pass --force to replace it once the export is complete")
    if exporter.is_file and output.suffix != ".gguf":
        raise QuantkitError(f"a GGUF export is one file: name it with .gguf (got '{output}')")
    source = open_export_source(checkpoint)
    exporter.check(source)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    remove_path(tmp)
    try:
        if not exporter.is_file:
            tmp.mkdir()
        summary = exporter.write(source, tmp)
        publish(tmp, output, overwrite=force)
    except OSError as exc:
        remove_path(tmp)
        if exc.errno == errno.ENOSPC:
            raise QuantkitError(f"no space left on the device of {output.parent}; free space and export again") from exc
        raise
    except BaseException:
        remove_path(tmp)
        raise
    summary.output = str(output)
    return summary
