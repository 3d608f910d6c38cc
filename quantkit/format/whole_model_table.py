"""The whole-model table of ``quantkit inspect``: every byte of the checkpoint by what it holds, with each row's share
and the whole file's bits per weight (all tensor bits over the source model's parameters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantkit.format.sizes import format_mb, mb_number

if TYPE_CHECKING:
    from rich.table import Table

    from quantkit.format.inspect import CheckpointReport


def whole_model_table(report: CheckpointReport) -> Table:
    from rich.table import Table

    table = Table(title="Whole model (every tensor byte)", show_footer=True)
    total = report.tensor_bytes
    columns = (("part", "all tensors"), ("params", ""), ("MB", mb_number(total)), ("share", "100.0%"))
    for (name, footer), justify in zip(columns, ("left", "right", "right", "right"), strict=True):
        table.add_column(name, footer, justify=justify)  # type: ignore[arg-type]
    for part in report.parts:
        share = 100 * part.bytes / total if total else 0.0
        params = f"{part.params:,}" if part.params else ""
        table.add_row(part.part, params, mb_number(part.bytes), f"{share:.1f}%")
    table.caption = (
        f"whole model {report.model_bits_per_weight:.3f} bits/w over the source's parameters; tensors "
        f"{format_mb(total)}, files {format_mb(report.checkpoint_bytes)} (the rest: safetensors headers)"
    )
    return table
