"""The algorithms beyond a weight solver under ``torchrun --nproc-per-node 2`` (gloo, one thread per process) on the
tiny Llama: the checkpoint bytes and the logged records of one process. 12 windows in mini-batches of 1 make 12
batches, 3 chunks of the Hessians' summation tree, cut 4 | 8 windows between the ranks, so AWQ's 8 search windows
come from both ranks, and the float targets' sums span a rank boundary and several chunks. A float-target run killed
on one rank resumes, on one process or two, to the bytes of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
STOP_WITHIN_S = 60.0


def _quantize(
    out: Path, model: Path, calib: Path, *extra: str, procs: int = 1, **env: str
) -> subprocess.CompletedProcess:
    args = ["quantize", str(model), "-o", str(out), "--group-size", "32", "--batch-size", "1", "--calib", str(calib)]
    launcher = [sys.executable, "-m", "quantkit"]
    if procs > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        launcher += ["-m", "quantkit"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("QUANTKIT_DIST_FAULT")}
    return subprocess.run(
        [*launcher, *args, *extra],
        env=clean | {"OMP_NUM_THREADS": "1"} | env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _records(out: Path) -> list[dict]:
    return json.loads((out / "quantkit_log.json").read_text())["layers"]


@pytest.fixture(scope="module")
def calib12(tiny_model_dir, tmp_path_factory) -> Path:
    from helpers.tiny import tiny_calibration

    return tiny_calibration(tiny_model_dir, tmp_path_factory.mktemp("calib12"), 12)


JOBS = {
    # AWQ's searches on windows of both ranks, then GPTQ towards the float model's outputs (the float path's rows)
    "awq-float-targets": ("--method", "awq+gptq", "--float-targets"),
    # SmoothQuant's maxima over every window; static FP8 input scales from the MSE observer's row sample; KV scales
    "smoothquant-fp8-mse-kv": (
        "--method",
        "smoothquant+gptq",
        "--scheme",
        "FP8",
        "--activation-observer",
        "mse",
        "--kv-cache-scheme",
        "fp8",
    ),
    # the rotated embedding's rows handed out by rank 0; the head refitted to the gathered final activations
    "rotation-refit-head": ("--rotate", "hadamard", "--float-targets", "--refit-head"),
    # tuning on rank 0 over every window (20 steps: the tuned weights are kept on both blocks)
    "tune": ("--tune-steps", "20"),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_two_processes_write_the_bytes_of_one(tiny_model_dir, calib12, tmp_path, job: str) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    single = _quantize(one, tiny_model_dir, calib12, *JOBS[job])
    assert single.returncode == 0, single.stderr
    done = _quantize(two, tiny_model_dir, calib12, *JOBS[job], procs=2)
    assert done.returncode == 0, done.stderr
    assert (two / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()
    assert _records(two) == _records(one)  # GPTQ's losses, AWQ's and SmoothQuant's choices: rank 0's are all's
    if job == "tune":
        assert [r["kept"] for r in _records(two) if r.get("kind") == "tune"] == [True, True]


def test_resume_of_a_float_target_run_after_a_killed_rank(tiny_model_dir, calib12, tmp_path) -> None:
    """The float model's rows are gathered into rank 0's work directory and handed out again on ``--resume``."""
    flags = ("--float-targets",)
    whole = tmp_path / "whole"
    assert _quantize(whole, tiny_model_dir, calib12, *flags).returncode == 0
    for procs in (1, 2):
        out = tmp_path / f"killed{procs}"
        start = time.monotonic()
        killed = _quantize(out, tiny_model_dir, calib12, *flags, procs=2, QUANTKIT_DIST_FAULT="0:1:kill")
        assert time.monotonic() - start < STOP_WITHIN_S and killed.returncode != 0
        state = json.loads((out.with_name(f"{out.name}.partial") / "state.json").read_text())
        assert state["finished"] == 1 and state.get("reference")  # block 0 and the float rows were saved
        resumed = _quantize(out, tiny_model_dir, calib12, *flags, "--resume", procs=procs)
        assert resumed.returncode == 0, resumed.stderr
        assert (out / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
        shutil.rmtree(out)
