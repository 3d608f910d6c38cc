"""The coverage audit as tables: one row per kind with the total, and the linears not written as a plain solve of
their asked scheme. Rows are plain text, so ``quantize`` and ``inspect`` (rich), the model card and the recipe
report (Markdown) show the same cells."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantkit.format.coverage import FLOAT, CoverageAudit, KindSummary, WeightRow
from quantkit.format.files import RUN_LOG
from quantkit.format.sizes import format_mb, mb_number

if TYPE_CHECKING:
    from rich.console import Group

KIND_HEADER = ["kind", "modules", "params", "quantized", "written as", "float linears", "fallbacks", "MB"]
EXCEPTION_HEADER = ["weight", "kind", "asked", "written", "why"]
MAX_EXCEPTIONS = 20  # rows shown; the run log lists every weight


def kind_rows(audit: CoverageAudit) -> list[list[str]]:
    """One row per kind, then the total."""
    rows = [_kind_row(s) for s in audit.kinds]
    total = KindSummary("all")
    for s in audit.kinds:
        total.modules += s.modules
        total.params += s.params
        total.quantized_params += s.quantized_params
        total.float_linears += s.float_linears
        total.layout_fallbacks += s.layout_fallbacks
        total.rtn_fallbacks += s.rtn_fallbacks
    total.bytes = audit.total_bytes
    last = _kind_row(total)
    last[4] = ""  # the schemes are in the rows above
    return [*rows, last]


def _kind_row(s: KindSummary) -> list[str]:
    share = f"{s.quantized_params / s.params:.1%}" if s.params else "-"
    schemes = ", ".join(f"{count} {name}" for name, count in sorted(s.schemes.items(), key=_float_last))
    fallbacks = [f"{s.layout_fallbacks} layout"] if s.layout_fallbacks else []
    fallbacks += [f"{s.rtn_fallbacks} RTN"] if s.rtn_fallbacks else []
    row = [s.kind, str(s.modules), f"{s.params:,}", share, schemes, str(s.float_linears)]
    return [*row, ", ".join(fallbacks) or "0", mb_number(s.bytes)]


def _float_last(item: tuple[str, int]) -> tuple[bool, str]:
    return item[0] == FLOAT, item[0]


def exception_rows(audit: CoverageAudit, limit: int | None = MAX_EXCEPTIONS) -> list[list[str]]:
    """The linears kept in float, given another layout, or solved by a fallback (at most ``limit``)."""
    rows = [_exception_row(row) for row in audit.exceptions()]
    return rows if limit is None else rows[:limit]


def _exception_row(row: WeightRow) -> list[str]:
    return [row.name, row.kind, row.intended, row.actual, row.note]


def fraction_line(audit: CoverageAudit) -> str:
    """The quantized fraction and the byte total, in one sentence."""
    return (
        f"quantized: {audit.quantized_fraction:.2%} of the block linears' weights ({audit.quantized_linear_params:,} "
        f"of {audit.linear_params:,} params); {format_mb(audit.total_bytes)} of tensor data (headers excluded)"
    )


def more_line(audit: CoverageAudit, shown: int) -> str:
    """What the exception rows leave out, or "" when they show every one."""
    left = len(audit.exceptions()) - shown
    return f"... and {left} more ({RUN_LOG} lists every weight)" if left > 0 else ""


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub Markdown table: text left, numbers right; pipes in cells escaped."""
    right = [all(_numeric(row[i]) for row in rows) for i in range(len(header))]
    cells = [[cell.replace("|", "\\|") for cell in row] for row in rows]
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if r else "---" for r in right) + "|",
        *("| " + " | ".join(row) + " |" for row in cells),
    ]


def _numeric(cell: str) -> bool:
    return cell.replace(",", "").replace(".", "").replace("%", "").isdigit() or cell == "-"


def coverage_markdown(audit: CoverageAudit) -> list[str]:
    """The per-kind table, the fraction and the exceptions, as Markdown lines."""
    lines = [*markdown_table(KIND_HEADER, kind_rows(audit)), "", fraction_line(audit) + "."]
    exceptions = exception_rows(audit)
    if exceptions:
        lines += ["", "Linears not written as asked:", "", *markdown_table(EXCEPTION_HEADER, exceptions)]
        lines += [more_line(audit, len(exceptions))] if more_line(audit, len(exceptions)) else []
    elif audit.intent_recorded:
        lines += ["", "Every block linear was written in the scheme asked for it."]
    return lines


def coverage_tables(audit: CoverageAudit, list_exceptions: bool = True) -> Group:
    """Rich tables: the kinds with the total (the fraction in the caption), then the exceptions, if any
    (``list_exceptions`` False: only counted in the caption, as ``quantize`` shows them)."""
    from rich.console import Group
    from rich.table import Table

    kinds = Table(title="Coverage (every weight, per kind)", title_justify="left")
    for column in KIND_HEADER:
        kinds.add_column(column, justify="left" if column in ("kind", "written as") else "right", overflow="fold")
    rows = kind_rows(audit)
    for i, row in enumerate(rows):
        if i == len(rows) - 1:
            kinds.add_section()
        kinds.add_row(*row)
    kinds.caption = fraction_line(audit) + "; MB = 10^6 bytes"
    exceptions = exception_rows(audit)
    if exceptions and not list_exceptions:
        kinds.caption += f"; {len(audit.exceptions())} linears not written as asked (quantkit inspect lists them)"
    if not exceptions or not list_exceptions:
        return Group(kinds)
    table = Table(title="Linears not written as asked", title_justify="left")
    for column in EXCEPTION_HEADER:
        table.add_column(column, overflow="fold")
    for row in exceptions:
        table.add_row(*row)
    table.caption = more_line(audit, len(exceptions)) or None
    return Group(kinds, table)
