"""``quantkit export``: a quantized checkpoint as GPTQ v1 or GGUF, from its integer codes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from quantkit.cli.app import JsonOption, app, out, write_json_option
from quantkit.export.run import EXPORT_FORMATS
from quantkit.export.source import ExportSummary


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint directory written by `quantkit quantize`.")],
    format: Annotated[str, typer.Option("--format", "-f", help=f"{' or '.join(EXPORT_FORMATS)}.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="GPTQ: a directory; GGUF: a .gguf file.")],
    force: Annotated[bool, typer.Option(help="Replace an existing output once the export is complete.")] = False,
    json_out: JsonOption = None,
) -> None:
    """Convert the stored integer codes to GPTQ v1 (AutoGPTQ/GPTQModel, vLLM gptq_marlin, TGI) or GGUF (llama.cpp),
    without requantizing; a scheme the format cannot hold exactly is an error that names it."""
    from quantkit.export.run import export_checkpoint

    summary = export_checkpoint(checkpoint, format, output, force=force)
    print_export(summary)
    write_json_option(json_out, asdict(summary))


def print_export(summary: ExportSummary) -> None:
    table = Table(title=f"Exported {summary.format} -> {summary.output}")
    table.add_column("stored as")
    table.add_column("tensors", justify="right")
    for kind, count in sorted(summary.tensor_types.items()):
        table.add_row(kind, str(count))
    table.caption = f"{summary.bytes / 1e6:.1f} MB"
    out.print(table)
    for note in summary.notes:
        out.print(f"note: {note}", soft_wrap=True, highlight=False)
