"""The ``quantkit`` Typer app, its consoles, and the entry point that turns user errors into one red line."""

from __future__ import annotations

import errno
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from quantkit import __version__
from quantkit.device import DEVICE_HELP
from quantkit.errors import QuantkitError


class _Commands(TyperGroup):
    """The root group: Ctrl-C inside a command becomes one line saying how far it got, and exit 130 (typer alone
    would exit 130 silently)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            report_interrupt(exc)
            raise typer.Exit(EXIT_INTERRUPTED) from None


app = typer.Typer(
    name="quantkit",
    cls=_Commands,
    help="Quantize Hugging Face causal LMs (RTN, GPTQ, AWQ, mixed precision), evaluate and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(emoji=False)
err = Console(stderr=True, emoji=False, highlight=False)
EXIT_INPUT_ERROR = 2
DISTRIBUTED_COMMANDS = ("quantkit quantize", "quantkit run")  # what runs on several processes under torchrun
EXIT_INTERRUPTED = 130

ModelOption = Annotated[str, typer.Option("--model", "-m", help="Local HF directory, hub id, or alias (smollm2-135m).")]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Write the results as one JSON object.")]
DeviceOption = Annotated[str, typer.Option(help=DEVICE_HELP)]


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


@contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Python warnings raised inside (a short calibration text, a layer that fell back to RTN) as one yellow
    line each on stderr, instead of a file:line header and source excerpt."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        err.print(f"[bold yellow]warning:[/] {escape(str(message))}", soft_wrap=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def main() -> None:
    """Console entry point: user errors (a missing extra among them) become one red line and exit code 2, Ctrl-C
    one line saying how far the work got and exit 130, a warning one yellow line (every command, recipes'
    stages included); never a traceback."""
    from quantkit.distributed.context import SameOnEveryRank, distributed_session, rank_label, world_from_env
    from quantkit.extras import missing_extra_error

    try:
        if world_from_env() is not None and _command_name() not in DISTRIBUTED_COMMANDS:
            raise SameOnEveryRank(
                f"{_command_name() or 'this command'} runs as one process; under torchrun use "
                f"{' or '.join(DISTRIBUTED_COMMANDS)}"
            )
        with distributed_session(), warnings_as_lines():  # under torchrun: the process group, for the whole command
            app()
    except QuantkitError as exc:
        if not isinstance(exc, SameOnEveryRank) or rank_label() in ("", "rank 0: "):  # torchrun: said once
            err.print(f"[bold red]error:[/] {escape(rank_label() + str(exc))}", soft_wrap=True)
        sys.exit(EXIT_INPUT_ERROR)
    except ModuleNotFoundError as exc:
        missing = missing_extra_error(exc, _command_name())
        if missing is None:
            raise
        err.print(f"[bold red]error:[/] {escape(str(missing))}", soft_wrap=True)
        sys.exit(EXIT_INPUT_ERROR)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        err.print(
            f"[bold red]error:[/] {escape(rank_label())}no space left on device{escape(where)}; free space and rerun "
            "(quantize: add --resume to continue after the last finished block)",
            soft_wrap=True,
        )
        sys.exit(EXIT_INPUT_ERROR)
    except KeyboardInterrupt as exc:  # outside a command (while parsing); inside one, _Commands reports it
        report_interrupt(exc)
        sys.exit(EXIT_INTERRUPTED)


def report_interrupt(exc: KeyboardInterrupt) -> None:
    """``interrupted``, or with a job's progress: ``interrupted after block 11/30; rerun with --resume ...``."""
    from quantkit.progress import Interrupted

    message = exc.message() if isinstance(exc, Interrupted) else "interrupted"
    err.print(f"[bold red]{escape(message)}[/]", soft_wrap=True)


def _command_name() -> str | None:
    """The command being run (``quantkit serve``, ``quantkit recipe validate``), read from the command line."""
    from typer.main import get_command

    command: Any = get_command(app)
    words = ["quantkit"]
    for arg in sys.argv[1:]:
        commands = getattr(command, "commands", None)
        if not isinstance(commands, Mapping) or arg not in commands:
            break
        command = commands[arg]
        words.append(arg)
    return " ".join(words) if len(words) > 1 else None
