"""Ctrl-C: one line saying how far the work got and how to go on, exit 130, no traceback; quantize continues with
--resume, a recipe by running it again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import run_cli

from quantkit.progress import Interrupted

INTERRUPTED = 130


def test_the_message_names_the_progress_and_the_way_on():
    exc = Interrupted(done=11, total=30, unit="block", hint="rerun with --resume to continue")
    assert isinstance(exc, KeyboardInterrupt)
    assert exc.message() == "interrupted after block 11/30; rerun with --resume to continue"
    inner = exc.within("stage quantize", "rerun the recipe to continue")
    assert inner.message() == "interrupted during stage quantize after block 11/30; rerun the recipe to continue"
    assert Interrupted().message() == "interrupted"


def _interrupt_at_block(monkeypatch, index: int) -> None:
    """Ctrl-C right after block ``index`` is saved (as a SIGINT there would raise it)."""
    from quantkit.quantization import workdir

    save = workdir.WorkDir.save_block

    def save_then_interrupt(self, i, *args, **kwargs):
        save(self, i, *args, **kwargs)
        if i == index:
            raise KeyboardInterrupt

    monkeypatch.setattr(workdir.WorkDir, "save_block", save_then_interrupt)


@pytest.mark.slow
def test_quantize_interrupted_says_where_and_resumes(tiny_model_dir, tiny_calib_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(tiny_calib_file), "--group-size", "32"]
    _interrupt_at_block(monkeypatch, 0)
    code, _, err = run_cli(args, capsys)
    assert code == INTERRUPTED
    assert err.strip().splitlines()[-1] == "interrupted after block 1/2; rerun with --resume to continue"
    assert "Traceback" not in err
    monkeypatch.undo()
    code, _, err = run_cli([*args, "--resume", "--json", str(tmp_path / "result.json")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "result.json").read_text())["resumed_from"] == 1


@pytest.mark.slow
def test_recipe_interrupted_in_quantize_resumes_on_the_next_run(
    tiny_model_dir, text_corpus, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"""\
model: {tiny_model_dir}
calibration: {{dataset: {text_corpus}, num_samples: 8, seq_len: 32}}
quantization: {{solvers: [gptq], scheme: {{bits: 4, group_size: 32}}}}
output: {{directory: {tmp_path / "ckpt"}, force: true}}
evaluation: {{dataset: {text_corpus}, seq_len: 32, windows: 2}}
gates: {{max_ppl_increase_pct: 1000}}
"""
    )
    args = ["run", str(recipe), "--report", str(tmp_path / "report")]
    _interrupt_at_block(monkeypatch, 0)
    code, _, err = run_cli(args, capsys)
    assert code == INTERRUPTED and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "interrupted during stage quantize after block 1/2; rerun the recipe to continue (finished stages and "
        "blocks are reused)"
    )
    monkeypatch.undo()
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    from quantkit.quantization import pipeline

    seen = []
    quantize_model = pipeline.quantize_model

    def recording(*args, **kwargs):
        seen.append(result := quantize_model(*args, **kwargs))
        return result

    monkeypatch.setattr(pipeline, "quantize_model", recording)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert [r.resumed_from for r in seen] == [1]  # the finished block was kept
    stages = json.loads((tmp_path / "report" / "report.json").read_text())["stages"]
    assert [s["cached"] for s in stages if s["name"] == "calibrate"] == [True]


def _quantize_command(model: Path, calib: Path, out: Path, *extra: str) -> list[str]:
    args = ["quantize", str(model), "-o", str(out), "--calib", str(calib), "--group-size", "32"]
    return [sys.executable, "-m", "quantkit", *args, *extra]


@pytest.mark.slow
def test_a_real_sigint_to_quantize_stops_after_a_finished_block_and_resume_completes(tmp_path, tiny_calib_file):
    """SIGINT to `python -m quantkit quantize` once a block is on disk: the run is held at its first state commit
    (QUANTKIT_STALL) so that the signal lands mid-run however fast the tiny blocks go on a loaded machine."""
    from helpers.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "model", num_hidden_layers=8)
    out = tmp_path / "out"
    state = tmp_path / "out.partial" / "state.json"
    gate = tmp_path / "hold"
    gate.touch()
    env = {k: v for k, v in os.environ.items() if k != "QUANTKIT_FAULT"} | {"QUANTKIT_STALL": f"state-written={gate}"}
    proc = subprocess.Popen(
        _quantize_command(model, tiny_calib_file, out), env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE
    )
    reached = gate.with_name(gate.name + ".reached")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not reached.exists():
        time.sleep(0.01)
    assert proc.poll() is None and reached.exists(), "quantize never reached its first state commit"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    err = stderr.decode()
    assert proc.returncode == INTERRUPTED, err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(r"interrupted after block (\d+)/8; rerun with --resume to continue", last)
    assert found is not None, err
    assert "Traceback" not in err
    done = int(found.group(1))
    assert 1 <= done <= 8 and json.loads(state.read_text())["finished"] == done

    gate.unlink()  # the resumed run goes through
    resumed = subprocess.run(
        _quantize_command(model, tiny_calib_file, out, "--resume", "--json", str(tmp_path / "result.json")),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["resumed_from"] == done and result["blocks"] == 8
    assert (out / "model.safetensors").is_file() and not state.parent.exists()
