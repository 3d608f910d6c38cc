"""Under torchrun, the commands that do not run distributed are refused before any process group starts: rank 0 says
so in one line, the other ranks exit with the same code in silence."""

from __future__ import annotations

import pytest
from helpers.cli import run_cli


@pytest.mark.parametrize(("rank", "printed"), [("0", True), ("1", False)])
def test_a_command_that_runs_as_one_process_is_refused_under_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path, rank: str, printed: bool
) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert code == 2
    line = f"error: rank {rank}: quantkit inspect runs as one process; under torchrun use quantkit quantize or"
    assert (line in " ".join(err.split())) is printed
    assert err.count("error") == int(printed)


def test_torchrun_with_one_process_is_the_plain_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, _, err = run_cli(["inspect", str(tmp_path / "missing")], capsys)
    assert code == 2 and "runs as one process" not in err  # inspect's own error: the command ran
