"""The tools of the scale and GPU checks: random models in real shapes, running a command under a RAM cap, and the
GPU check's JSON plumbing (its steps themselves need a GPU; --dry-run runs them on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.paths import REPO

from tools import gpu_check, memory_cap, random_model

# holds the memory for a second: the cap's poller must see it before the process exits
ALLOCATE = (
    "import time; x = bytearray({n}); x[::4096] = b'1' * len(x[::4096]); print('held', flush=True); time.sleep(1)"
)


@pytest.mark.slow
def test_a_random_model_has_the_preset_shapes_and_is_built_once(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = random_model.build_random_model(tmp_path / "m", "tiny", shard_mb=1)
    shape = random_model.PRESETS["tiny"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == random_model.parameter_count(shape)
    assert model.config.vocab_size == shape.vocab and model.config.tie_word_embeddings
    ids = AutoTokenizer.from_pretrained(out)("It is a truth universally acknowledged").input_ids
    assert len(ids) == 6 and max(ids) < shape.vocab and len(AutoTokenizer.from_pretrained(out)) == shape.vocab
    stamp = (out / "config.json").stat().st_mtime_ns
    random_model.build_random_model(tmp_path / "m", "tiny", shard_mb=1)
    assert (out / "config.json").stat().st_mtime_ns == stamp  # the same build is reused
    random_model.build_random_model(tmp_path / "m", "tiny", shard_mb=1, seed=1)
    assert (out / "config.json").stat().st_mtime_ns != stamp


def test_a_sharded_random_model_has_an_index(tmp_path: Path) -> None:
    shape = random_model.Shape(256, 3, 4, 2, 512, 1000, tied=False, rope_theta=10000.0)
    random_model.PRESETS["test-sharded"] = shape
    try:
        out = random_model.build_random_model(tmp_path / "m", "test-sharded", shard_mb=1)
    finally:
        del random_model.PRESETS["test-sharded"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(out.glob("model-*.safetensors"))) > 1
    assert index["metadata"]["total_size"] == random_model.parameter_count(shape) * 2
    assert "lm_head.weight" in index["weight_map"]


@pytest.mark.parametrize("use_cgroup", [False, True])
def test_a_command_over_the_cap_is_killed_and_one_under_it_is_measured(use_cgroup: bool) -> None:
    if use_cgroup:
        probe = memory_cap._Cgroup.create(1 << 30)
        if probe is None:
            pytest.skip("no writable memory cgroup here")
        probe.remove()
    command = [sys.executable, "-c", ALLOCATE.format(n=300_000_000)]
    over = memory_cap.run_capped(command, 150_000_000, use_cgroup=use_cgroup)
    assert over.killed_over_cap and over.returncode != 0
    lines: list[str] = []
    under = memory_cap.run_capped(command, 2_000_000_000, use_cgroup=use_cgroup, on_line=lines.append)
    assert under.returncode == 0 and not under.killed_over_cap and lines == ["held"]
    assert 300e6 < under.peak_anon_bytes <= under.peak_rss_bytes < 2e9 and under.enforcement.startswith(
        "cgroup" if use_cgroup else "watch"
    )


def test_junit_reports_and_step_results_merge_into_one_json(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="t.a" name="ok"/><testcase classname="t.a" name="bad"><failure/></testcase>'
        '<testcase classname="t.a" name="skip"><skipped/></testcase></testsuite></testsuites>'
    )
    steps = tmp_path / "steps"
    steps.mkdir()
    gpu_check.junit(report, steps / "kernels.json")
    (steps / "kernels.status.json").write_text(json.dumps({"rc": 1, "seconds": 2.0}))
    (steps / "env.status.json").write_text(json.dumps({"rc": 0, "seconds": 1.0}))
    gpu_check.merge(steps, tmp_path / "all.json")
    merged = json.loads((tmp_path / "all.json").read_text())["steps"]
    assert merged["kernels"]["result"] == {
        "tests": 3,
        "failures": 1,
        "errors": 0,
        "skipped": 1,
        "passed": 1,
        "failed": ["t.a::bad"],
    }
    assert merged["env"] == {"rc": 0, "seconds": 1.0}


@pytest.mark.slow
def test_the_gpu_check_runs_its_steps_on_the_cpu(tmp_path: Path) -> None:
    """--dry-run: tiny models on the CPU; a failing step is recorded and the next one runs."""
    out = tmp_path / "out"
    env = {"GPU_CHECK_WORK": str(tmp_path / "work"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    env["GPU_CHECK_LIMIT_GPTQ"] = "1"  # too short to finish: recorded as timed out
    result = subprocess.run(
        [
            "bash",
            str(REPO / "tools" / "gpu_check.sh"),
            "--dry-run",
            "--out",
            str(out),
            "env",
            "parity",
            "gptq",
            "decode",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert steps["env"]["ok"] and steps["env"]["result"]["cuda"] is (torch.cuda.is_available())
    parity = steps["parity"]["result"]
    assert steps["parity"]["ok"] and parity["identical"] == parity["prompts"] == 2  # float32 on the CPU: exact
    assert steps["gptq"]["timed_out"] and not steps["gptq"]["ok"]
    rows = steps["decode"]["result"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["tokens_per_s"] > 0 for r in rows)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
