"""Run the quantkit console entry point in-process and capture exit code and output."""

from __future__ import annotations

import sys

import pytest


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from quantkit.cli import main

    old = sys.argv
    sys.argv = ["quantkit", *args]
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        sys.argv = old
    captured = capsys.readouterr()
    return code, captured.out, captured.err
