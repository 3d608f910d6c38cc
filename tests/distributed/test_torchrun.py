"""``torchrun --nproc-per-node 2 -m quantkit quantize`` on CPUs (gloo, one thread per process) on the tiny Llama:
the same checkpoint bytes and the same logged losses (so the same Hessians, bit for bit) as one process; a rank
that fails stops both, in one line naming it; ``--resume`` after a killed rank, with one process or two, finishes
with the bytes of an uninterrupted run."""

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


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTKIT_DIST_FAULT")}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def _quantize(
    out: Path, model: Path, calib: Path, *extra: str, procs: int = 1, **env: str
) -> subprocess.CompletedProcess:
    args = ["quantize", str(model), "-o", str(out), "--group-size", "32", "--batch-size", "2", *extra]
    if "rtn" not in extra:
        args += ["--calib", str(calib)]
    launcher = [sys.executable, "-m", "quantkit"]
    if procs > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        launcher += ["-m", "quantkit"]
    return subprocess.run([*launcher, *args], env=_env(**env), capture_output=True, text=True, timeout=300, check=False)


def _losses(out: Path) -> list[float | None]:
    return [layer.get("loss") for layer in json.loads((out / "quantkit_log.json").read_text())["layers"]]


@pytest.fixture(scope="module")
def calib18(tiny_model_dir, tmp_path_factory) -> Path:
    """18 windows: 9 mini-batches of 2, chunks of 4, 4 and 1 batches, cut 8 | 10 windows between two ranks."""
    from helpers.tiny import tiny_calibration

    return tiny_calibration(tiny_model_dir, tmp_path_factory.mktemp("calib18"), 18)


@pytest.fixture(scope="module")
def single_gptq(tiny_model_dir, calib18, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "gptq"
    done = _quantize(out, tiny_model_dir, calib18)
    assert done.returncode == 0, done.stderr
    return out


def test_two_processes_write_the_bytes_of_one(tiny_model_dir, calib18, single_gptq, tmp_path) -> None:
    out = tmp_path / "two"
    done = _quantize(out, tiny_model_dir, calib18, "--json", str(tmp_path / "r.json"), procs=2)
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors").read_bytes() == (single_gptq / "model.safetensors").read_bytes()
    assert _losses(out) == _losses(single_gptq)  # each loss reads the Hessian: equal floats, equal sums
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["processes"] == 2 and len(result["rank_seconds"]) == 2
    assert done.stdout.count("Quantized") == 1  # the tables from rank 0 only


def test_round_to_nearest_on_two_processes(tiny_model_dir, calib18, tmp_path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    assert _quantize(one, tiny_model_dir, calib18, "--method", "rtn").returncode == 0
    done = _quantize(two, tiny_model_dir, calib18, "--method", "rtn", procs=2)
    assert done.returncode == 0, done.stderr
    assert (two / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()


def test_a_rank_that_raises_stops_every_rank_in_one_line(tiny_model_dir, calib18, tmp_path) -> None:
    out = tmp_path / "failed"
    start = time.monotonic()
    done = _quantize(out, tiny_model_dir, calib18, procs=2, QUANTKIT_DIST_FAULT="1:1")
    assert time.monotonic() - start < STOP_WITHIN_S
    assert done.returncode != 0
    assert "rank 1 failed: InjectedFault: injected failure at block 1" in done.stderr
    state = json.loads((out.with_name("failed.partial") / "state.json").read_text())
    assert state["finished"] == 1  # block 0 was saved by rank 0 before rank 1 failed


@pytest.mark.parametrize("procs", [1, 2])
def test_resume_after_a_killed_rank(tiny_model_dir, calib18, single_gptq, tmp_path, procs: int) -> None:
    out = tmp_path / "killed"
    start = time.monotonic()
    killed = _quantize(out, tiny_model_dir, calib18, procs=2, QUANTKIT_DIST_FAULT="0:1:kill")
    assert time.monotonic() - start < STOP_WITHIN_S and killed.returncode != 0
    assert not out.exists()
    resumed = _quantize(out, tiny_model_dir, calib18, "--resume", procs=procs)
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "model.safetensors").read_bytes() == (single_gptq / "model.safetensors").read_bytes()
    assert not out.with_name("killed.partial").exists()
    shutil.rmtree(out)


def test_an_algorithm_that_does_not_run_distributed_is_refused_once(tiny_model_dir, calib18, tmp_path) -> None:
    refused = ("--scheme", "FP8", "--activation-observer", "mse", "--moe-calibration", "routed")
    done = _quantize(tmp_path / "mse", tiny_model_dir, calib18, *refused, procs=2)
    assert done.returncode != 0
    assert done.stderr.count("--moe-calibration routed cannot run on 2 processes yet") == 1
    assert not (tmp_path / "mse").exists()


def test_a_mixture_of_experts_model_on_two_processes(calib18, tmp_path) -> None:
    """Routed calibration (each expert sees its tokens only; an expert no token reaches falls back): the routing
    counts and the experts' Hessians are summed over the ranks, the chunks of experts spread over them."""
    from helpers.moe import save_tiny_moe

    model = save_tiny_moe(tmp_path / "moe", "qwen3_moe", unused_experts=(3,))
    one, two = tmp_path / "one", tmp_path / "two"
    routed = ("--moe-calibration", "routed")
    assert _quantize(one, model, calib18, *routed).returncode == 0
    done = _quantize(two, model, calib18, *routed, procs=2)
    assert done.returncode == 0, done.stderr
    assert (two / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()
    log = json.loads((two / "quantkit_log.json").read_text())["layers"]
    assert log == json.loads((one / "quantkit_log.json").read_text())["layers"]  # losses, routed tokens, fallbacks
    assert any(layer.get("fell_back_to_rtn") for layer in log)  # the unused expert, on both


def test_a_recipe_on_two_processes(tiny_model_dir, calib18, tmp_path) -> None:
    """Rank 0 runs the recipe (calibration, evaluation, gates); the other rank joins its quantize stage: the same
    bytes as the recipe on one process."""
    outputs = {}
    for procs in (1, 2):
        recipe = tmp_path / f"recipe{procs}.yaml"
        recipe.write_text(
            f"model: {tiny_model_dir}\n"
            f"calibration: {{dataset: {calib18.with_name('text.txt')}, num_samples: 18, seq_len: 32}}\n"
            "quantization:\n"
            "  scheme: {bits: 4, group_size: 32, symmetric: true}\n"
            "  batch_size: 2\n"
            "  solvers: {gptq: {}}\n"
            f"output: {{directory: {tmp_path / f'out{procs}'}, force: true}}\n"
            f"evaluation: {{windows: 1, seq_len: 32, dataset: {calib18.with_name('text.txt')}}}\n"
        )
        launcher = [sys.executable, "-m", "quantkit"]
        if procs > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
            launcher.append("quantkit")
        done = subprocess.run(
            [*launcher, "run", str(recipe)], env=_env(), capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr
        outputs[procs] = (tmp_path / f"out{procs}" / "model.safetensors").read_bytes()
    assert outputs[1] == outputs[2]
