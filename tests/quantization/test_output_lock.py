"""One run per output: a second run on a live run's output is refused in one line naming the holder, the first run
writes the same bytes as a lone run, and a run killed with SIGKILL leaves nothing that blocks the next one (which
takes over and resumes to the same bytes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.quantization.leftovers import leftovers
from quantkit.quantization.output_lock import OutputBusy, lock_path, output_lock

HOLD = "import sys, time; from quantkit.quantization.output_lock import output_lock\n" \
    "with output_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n"  # fmt: skip


def _holder(output: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    output = tmp_path / "out"
    holder = _holder(output)
    try:
        with (
            pytest.raises(OutputBusy, match=rf"'{output}' is being written by another quantkit run \(pid {holder.pid}"),
            output_lock(output),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holders_lock_is_free_at_once(tmp_path: Path) -> None:
    output = tmp_path / "out"
    holder = _holder(output)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lock_path(output).exists()  # left behind by the kill ...
    with output_lock(output):  # ... and free
        with output_lock(output):  # re-entrant within one process (a recipe and its quantize stage)
            pass
        assert lock_path(output).exists()
    assert not lock_path(output).exists()  # the holder removes it on the way out


def test_leftovers_are_judged_by_the_lock_not_by_pids(tmp_path: Path) -> None:
    output = tmp_path / "out"
    live = os.getppid()  # a live process's pid: a pid check would keep its temporaries
    for name in (f"out.tmp-{live}", f".out.old-{live}", f".out.partial.retired-{live}", f"out.tmp-{os.getpid()}"):
        (tmp_path / name).mkdir()
    with output_lock(output):
        found = sorted(p.name for p in leftovers(output))
    assert found == [f".out.old-{live}", f".out.partial.retired-{live}", f"out.tmp-{live}"]


def _quantize(model: Path, calib: Path, out: Path, *extra: str, stall: Path | None = None) -> subprocess.Popen[str]:
    args = ["quantize", str(model), "-o", str(out), "--calib", str(calib), "--group-size", "32", "--batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if stall is not None:  # held after its first block until the file is removed (quantkit/faults.py)
        env["QUANTKIT_STALL"] = f"state-written={stall}"
    return subprocess.Popen(
        [sys.executable, "-m", "quantkit", *args, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


TUNED = ("--tune-steps", "3")


@pytest.mark.slow
def test_two_runs_on_one_output(tiny_model_dir: Path, tiny_calib_file: Path, tmp_path: Path) -> None:
    lone, shared = tmp_path / "lone", tmp_path / "shared"
    assert _quantize(tiny_model_dir, tiny_calib_file, lone, *TUNED).wait(timeout=600) == 0
    gate = tmp_path / "gate"
    gate.touch()
    first = _quantize(tiny_model_dir, tiny_calib_file, shared, *TUNED, stall=gate)
    _wait_for(lambda: gate.with_name("gate.reached").exists())  # the first run holds its lock, one block done
    for extra in ((), ("--force",), ("--resume",)):
        second = _quantize(tiny_model_dir, tiny_calib_file, shared, *TUNED, *extra)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and f"being written by another quantkit run (pid {first.pid}" in lines[0]
    gate.unlink()
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    for name in ("model.safetensors", "quantkit_log.json"):
        assert (lone / name).read_bytes() == (shared / name).read_bytes(), name


@pytest.mark.slow
def test_a_killed_run_is_taken_over_and_resumed_to_the_same_bytes(
    tiny_model_dir: Path, tiny_calib_file: Path, tmp_path: Path
) -> None:
    lone, killed = tmp_path / "lone", tmp_path / "killed"
    assert _quantize(tiny_model_dir, tiny_calib_file, lone, *TUNED).wait(timeout=600) == 0
    gate = tmp_path / "gate"
    gate.touch()
    first = _quantize(tiny_model_dir, tiny_calib_file, killed, *TUNED, stall=gate)
    _wait_for(lambda: gate.with_name("gate.reached").exists())  # one block done, the lock held
    first.send_signal(signal.SIGKILL)
    first.wait()
    resumed = _quantize(tiny_model_dir, tiny_calib_file, killed, *TUNED, "--resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    for name in ("model.safetensors", "quantkit_log.json"):
        assert (lone / name).read_bytes() == (killed / name).read_bytes(), name
    assert not lock_path(killed).exists() and not killed.with_name("killed.partial").exists()
