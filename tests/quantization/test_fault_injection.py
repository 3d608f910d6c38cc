"""Kill the process at every commit point of a quantization (as ``kill -9`` would), resume, and require the same
bytes as an uninterrupted run and no leftovers; a full disk is one line, exit 2, and resumable."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli

from quantkit.faults import POINTS

pytestmark = pytest.mark.slow
KILLED = 137
# (point, pass, variant): the tiny model has 2 blocks; each point is hit at its first and, per block, its last pass
CASES = [
    ("block-written", 1, "plain"),
    ("block-written", 2, "plain"),
    ("hidden-written", 1, "plain"),
    ("hidden-written", 2, "plain"),
    ("state-written", 1, "plain"),
    ("state-written", 2, "plain"),
    ("checkpoint-staged", 1, "plain"),
    ("checkpoint-written", 1, "plain"),
    ("work-dir-retired", 1, "plain"),
    ("outer-written", 1, "rotated-tuned"),
    ("reference-written", 1, "rotated-tuned"),
    ("reference-written", 2, "rotated-tuned"),
    ("state-written", 2, "rotated-tuned"),
    ("reference-written", 2, "rotated-float-targets"),
    ("state-written", 2, "rotated-float-targets"),
]
# the options of each variant: a rotated, tuned run keeps two more kinds of state (outer tensors, float inputs); with
# float targets the float inputs come from the float path that runs beside the quantized block
VARIANTS = {
    "plain": (),
    "rotated-tuned": ("--rotate", "hadamard", "--tune-steps", "3"),
    "rotated-float-targets": ("--rotate", "hadamard", "--float-targets", "--refit-head"),
}
FILES = ("model.safetensors", "config.json", "quantkit_log.json", "tokenizer.json")


def _quantize(
    model: Path, calib: Path, out: Path, *extra: str, fault: str | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QUANTKIT_FAULT"}
    if fault:
        env["QUANTKIT_FAULT"] = fault
    args = ["quantize", str(model), "-o", str(out), "--calib", str(calib), "--group-size", "32", *extra]
    return subprocess.run(
        [sys.executable, "-m", "quantkit", *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def references(tiny_model_dir, calib_file, tmp_path_factory) -> dict[str, Path]:
    """Each variant's uninterrupted output, made on first use."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            out = tmp_path_factory.mktemp(f"reference-{variant}") / "out"
            done = _quantize(tiny_model_dir, calib_file, out, *VARIANTS[variant])
            assert done.returncode == 0, done.stderr
            made[variant] = out
        return made[variant]

    return get


@pytest.fixture(scope="module")
def reference(references) -> Path:
    return references("plain")


@pytest.fixture(scope="module")
def calib_file(tiny_calib_file) -> Path:
    return tiny_calib_file


def test_every_commit_point_is_covered():
    assert {point for point, _, _ in CASES} == set(POINTS)


@pytest.mark.parametrize(("point", "nth", "variant"), CASES, ids=[f"{p}@{n}-{v}" for p, n, v in CASES])
def test_a_kill_at_a_commit_point_resumes_to_the_same_bytes(
    tiny_model_dir, calib_file, references, tmp_path, point, nth, variant
):
    out = tmp_path / "out"
    reference = references(variant)
    killed = _quantize(tiny_model_dir, calib_file, out, *VARIANTS[variant], fault=f"{point}@{nth}")
    assert killed.returncode == KILLED, killed.stderr
    resumed = _quantize(tiny_model_dir, calib_file, out, *VARIANTS[variant], "--resume")
    assert resumed.returncode == 0, resumed.stderr
    for name in FILES:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no work directory, temporary or retired copy
    if point in ("checkpoint-written", "work-dir-retired"):
        assert "already complete" in resumed.stdout  # nothing redone


def test_resume_without_flag_does_not_discard_an_interrupted_run(tiny_model_dir, calib_file, tmp_path):
    out = tmp_path / "out"
    assert _quantize(tiny_model_dir, calib_file, out, fault="state-written@1").returncode == KILLED
    again = _quantize(tiny_model_dir, calib_file, out)
    assert again.returncode == 2 and "holds an interrupted run (1 blocks done); pass --resume" in again.stderr
    assert (tmp_path / "out.partial" / "block_0000.safetensors").is_file()
    other = _quantize(tiny_model_dir, calib_file, out, "--resume", "--method", "rtn")
    assert other.returncode == 2 and "the method, scheme or solver options differ" in other.stderr


def test_a_full_disk_is_one_line_exit_2_and_resumable(
    tiny_model_dir, calib_file, reference, tmp_path, capsys, monkeypatch
):
    from quantkit.quantization import workdir

    real_save = workdir.save_file
    calls = {"n": 0}

    def save_until_full(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(workdir, "save_file", save_until_full)
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(calib_file), "--group-size", "32"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "no space left on device writing" in err and "--resume" in err and "Traceback" not in err
    monkeypatch.setattr(workdir, "save_file", real_save)
    code, _, err = run_cli([*args, "--resume"], capsys)
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def test_weights_edited_in_place_are_not_resumed_over(tmp_path, calib_file, capsys):
    from helpers.tiny import save_tiny_model
    from safetensors.torch import load_file, save_file

    model = save_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    assert _quantize(model, calib_file, out, fault="state-written@1").returncode == KILLED
    weights = model / "model.safetensors"
    tensors = load_file(str(weights))
    size = weights.stat().st_size
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 1.0  # same names, shapes and file size
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == size
    resumed = _quantize(model, calib_file, out, "--resume")
    assert resumed.returncode == 2 and "the model weights differ from the interrupted run's" in resumed.stderr


def test_too_little_free_space_fails_before_any_work_with_the_numbers(
    tiny_model_dir, calib_file, tmp_path, capsys, monkeypatch
):
    import shutil as shutil_module

    from quantkit.quantization import disk_space

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(calib_file), "--group-size", "32"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "has 0 MB free and this run needs about" in err and "checkpoint ~" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
