"""Run the quantkit console entry point in-process and capture exit code and output."""

from __future__ import annotations

import sys

import pytest


def cli_exit_code(args: list[str]) -> int:
    """The CLI's exit code, its output left to pytest's capture (for module fixtures, which cannot take capsys)."""
    from quantkit.cli import main

    old = sys.argv
    sys.argv = ["quantkit", *args]
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        sys.argv = old
    return 0


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli_exit_code(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
