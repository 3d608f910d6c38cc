"""On the real SmolLM2: ``torchrun --nproc-per-node 2`` (gloo, one thread per process) writes the
``model.safetensors`` of a one-process run with the same 32 calibration windows, byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
WINDOWS = 32  # 8 mini-batches of 4: one chunk of the fixed summation tree per rank


def _quantize(out: Path, calib: Path, procs: int) -> None:
    launcher = [sys.executable, "-m", "quantkit"]
    if procs > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        launcher += ["-m", "quantkit"]
    args = ["quantize", "smollm2-135m", "-o", str(out), "--method", "gptq", "--bits", "4", "--group-size", "64"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, *args, "--calib", str(calib)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_two_processes_write_the_bytes_of_one_on_smollm2(smollm2_dir, tmp_path) -> None:
    from quantkit.data.calibration import CalibrationConfig, build_calibration

    calib = tmp_path / "calib.safetensors"
    build_calibration(str(smollm2_dir), CalibrationConfig(num_samples=WINDOWS, seq_len=256), output=calib)
    one, two = tmp_path / "one", tmp_path / "two"
    _quantize(one, calib, procs=1)
    _quantize(two, calib, procs=2)
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()
