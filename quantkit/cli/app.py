"""The ``quantkit`` Typer app, its consoles, and the entry point that turns user errors into one red line."""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from quantkit import __version__
from quantkit.errors import QuantkitError

app = typer.Typer(
    name="quantkit",
    help="Quantize Hugging Face causal LMs (RTN, GPTQ, AWQ, mixed precision), evaluate and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(emoji=False)
err = Console(stderr=True, emoji=False, highlight=False)
EXIT_INPUT_ERROR = 2
EXIT_INTERRUPTED = 130

ModelOption = Annotated[str, typer.Option("--model", "-m", help="Local HF directory, hub id, or alias (smollm2-135m).")]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Write the results as one JSON object.")]


def _version(value: bool) -> None:
    if value:
        out.print(f"quantkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """quantkit: offline quantization and model compression for causal LMs."""


def write_json_option(path: Path | None, data: dict[str, Any]) -> None:
    """``--json PATH``: the command's results as one JSON object, written atomically."""
    if path is not None:
        from quantkit.atomic import write_json

        write_json(path, data)


def fail(lines: list[str], label: str) -> None:
    """Print each failure as a red line and exit 1 (a gate or check failed; input errors exit 2)."""
    for line in lines:
        err.print(f"[bold red]{label}:[/] {escape(line)}", soft_wrap=True)
    raise typer.Exit(1)


def main() -> None:
    """Console entry point: user errors become one red line and exit code 2, never a traceback."""
    try:
        app()
    except QuantkitError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(EXIT_INPUT_ERROR)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        err.print(
            f"[bold red]error:[/] no space left on device{escape(where)}; free space and rerun "
            "(quantize: add --resume to continue after the last finished block)",
            soft_wrap=True,
        )
        sys.exit(EXIT_INPUT_ERROR)
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        sys.exit(EXIT_INTERRUPTED)
