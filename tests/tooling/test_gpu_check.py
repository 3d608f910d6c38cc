"""tools/gpu_check.sh, the one prepared GPU check: its deadline logic (a step over its limit is killed, a step that no
longer fits is skipped, the summary still prints), its live results, and a dry run of every step on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.paths import REPO

from tools import gpu_check, gpu_check_bench, gpu_check_run
from tools.gpu_check_run import Run, Step, run_plan

SCRIPT = REPO / "tools" / "gpu_check.sh"


def _run(tmp_path: Path, budget: float) -> Run:
    return Run(tmp_path / "out", tmp_path / "results", budget, time.time(), {"dry_run": True})


def _shell(line: str) -> list[str]:
    return ["bash", "-c", line]


def test_a_step_over_its_limit_is_killed_and_a_step_that_no_longer_fits_is_skipped(tmp_path, capsys):
    plan = [
        Step("slow", limit=1, need=0),
        Step("big", limit=5, need=100),
        Step("after_slow", limit=5, need=0, after=("slow",)),
        Step("quick", limit=5, need=0),
    ]
    commands = {
        "slow": "echo slow-began; sleep 30",
        "big": "true",
        "after_slow": "true",
        "quick": 'mkdir -p $R/quick && echo \'{"figures": {"answer": 42}}\' > $R/quick/q.json',
    }
    run = _run(tmp_path, budget=30)
    start = time.time()
    env = {**os.environ, "R": str(run.results)}
    records = run_plan(plan, lambda step: _shell(commands[step.name]), run, env)
    assert time.time() - start < 1 + gpu_check_run.GRACE_S + 3  # killed at its limit, not after its 30 s
    statuses = [records[n].status for n in ("slow", "big", "after_slow", "quick")]
    assert statuses == ["timed_out", "skipped", "skipped", "ok"]
    assert (
        records["big"].reason.startswith("needs ~100s") and records["after_slow"].reason == "needs slow to pass first"
    )
    summary = json.loads((run.out / "gpu_check.json").read_text())
    assert summary["finished"] and summary["steps"]["quick"]["result"] == {"q": {"figures": {"answer": 42}}}
    log = (run.out / "gpu_check.log").read_text()
    assert "START slow" in log and "slow-began" in log and "SKIP big" in log  # the killed step's output came back
    printed = capsys.readouterr().out
    assert "GPU check summary" in printed and "answer: 42" in printed
    assert printed.index("timed_out") < printed.index("answer: 42") and printed.rstrip().endswith("gpu_check.json")


def test_the_summary_shows_a_running_step_and_its_results_before_it_ends(tmp_path, monkeypatch):
    """What the device tool returns after a call killed mid-step: the started marker and the figures so far."""
    monkeypatch.setattr(gpu_check_run, "MERGE_EVERY_S", 0.1)
    run = _run(tmp_path, budget=30)
    partial = 'mkdir -p $R/long && echo \'{"figures": {"rows": 1}}\' > $R/long/part.json && sleep 2'
    env = {**os.environ, "R": str(run.results)}
    thread = threading.Thread(target=run_plan, args=([Step("long", 10, 0)], lambda s: _shell(partial), run, env))
    thread.start()
    seen = None
    for _ in range(100):
        time.sleep(0.05)
        path = run.out / "gpu_check.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        step = data.get("steps", {}).get("long", {})
        if step.get("result"):
            seen = step
            break
    thread.join()
    assert seen is not None and seen["status"] == "running" and seen["result"]["part"]["figures"] == {"rows": 1}
    assert seen["started_at_s"] is not None and not data["finished"]


def test_limits_scale_by_a_fraction_and_one_limit_can_be_replaced():
    scale, overrides = gpu_check_run.limit_overrides(
        {"GPU_CHECK_LIMIT_SCALE": "0.5", "GPU_CHECK_LIMIT_DECODE7B": "12.5"}
    )
    plan = {s.name: s for s in gpu_check_run.scaled_plan([], scale, overrides)}
    assert plan["env"].limit == 15 and plan["env"].need == 2.5 and plan["decode7b"].limit == 12.5
    only = gpu_check_run.scaled_plan(["decode7b"], 1, {})
    assert [s.name for s in only] == ["decode7b"] and only[0].after == ()  # rtn7b not asked for: it ran before
    with pytest.raises(SystemExit, match="GPU_CHECK_LIMIT_\\* must be numbers"):
        gpu_check_run.limit_overrides({"GPU_CHECK_LIMIT_SCALE": "half"})
    with pytest.raises(SystemExit, match="unknown step 'decode'; the steps are: env install"):
        gpu_check_run.scaled_plan(["decode"], 1, {})


def test_the_plan_fits_its_floors_in_the_default_budget():
    floors = sum(s.need for s in gpu_check_run.PLAN)
    assert floors + gpu_check_run.RESERVE_S < 450 and [s.name for s in gpu_check_run.PLAN][:3] == [
        "env",
        "install",
        "smoke",
    ]


def test_the_script_skips_what_no_longer_fits_and_still_prints_the_summary(tmp_path):
    """The shell entry point with a fractional scale: env killed at its (scaled) limit, smoke skipped."""
    env = {**os.environ, "GPU_CHECK_WORK": str(tmp_path / "work"), "GPU_CHECK_LIMIT_SCALE": "0.5"}
    env["GPU_CHECK_LIMIT_ENV"] = "0.2"  # importing torch alone takes longer
    out = tmp_path / "out"
    command = ["bash", str(SCRIPT), "--dry-run", "--budget", "12", "--out", str(out), "env", "smoke"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 1, result.stdout + result.stderr  # a step timed out
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert steps["env"]["status"] == "timed_out" and steps["env"]["limit_s"] == 0.2
    assert steps["smoke"]["status"] == "skipped" and "needs ~15s" in steps["smoke"]["reason"]
    assert "GPU check summary" in result.stdout and "arithmetic" not in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]


def test_the_device_call_is_written_at_the_top_of_the_script():
    head = SCRIPT.read_text().splitlines()[:4]
    call = next(line for line in head if "run(command=" in line)
    command = call.split('command="', 1)[1].split('"', 1)[0]
    assert command == "bash tools/gpu_check.sh --budget 450 --out $OUT" and len(command) < 2000
    assert 'carry=[".whl"]' in call and "timeout_s=480" in call


def test_junit_reports_become_counts_and_figures(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="t.a" name="ok"/><testcase classname="t.a" name="bad"><failure/></testcase>'
        '<testcase classname="t.a" name="skip"><skipped/></testcase></testsuite></testsuites>'
    )
    gpu_check.junit(report, tmp_path / "k.json")
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["failed"] == ["t.a::bad"] and result["passed"] == 1
    assert result["figures"] == {"passed": 1, "failed": 1, "skipped": 1, "first_failures": "a::bad"}


def test_bench_figures_name_the_attention_and_matmul_rows(tmp_path):
    rows = [
        ("paged_attention", "llama7b H32/32 D128 ctx4096", 16, 0.2, 0.4, 0.1),
        ("quant_matmul", "llama7b 4096x11008 w4g128", 1, 0.05, 0.1, 0.04),
        ("quant_matmul", "llama7b 4096x4096 w4g128", 1, 0.02, 0.04, 0.01),
    ]
    keys = ("kernel", "shape", "m", "triton_ms", "torch_ms", "bound_ms")
    records = [dict(zip(keys, r, strict=True)) for r in rows]
    for r in records:
        r["speedup"], r["bandwidth_fraction"] = r["torch_ms"] / r["triton_ms"], r["bound_ms"] / r["triton_ms"]
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"device": "H100", "copy_bandwidth_gb_s": 3000.0, "rows": records}))
    gpu_check_bench.bench_figures(bench, tmp_path / "f.json")
    figures = json.loads((tmp_path / "f.json").read_text())["figures"]
    assert figures["attention ctx4096 b16"] == "200.0us 2.00x torch 50% of bw"
    assert figures["w4g128 4096x11008 m1"] == "50.0us 2.00x torch 80% of bw" and len(figures) == 4


def test_the_sweep_tries_the_default_first_and_only_group_uniform_tiles(monkeypatch):
    from quantkit.runtime.kernels import quant_matmul

    monkeypatch.setattr(quant_matmul, "_num_sms", lambda device: 132)
    for m in gpu_check_bench.BUCKETS:
        configs = gpu_check_bench.candidates(m, 132)
        default = quant_matmul.default_config(m, gpu_check_bench.N, gpu_check_bench.K, 4, 128, False, "cuda")
        assert configs[0] == default and len(set(configs)) == len(configs) >= 5
        assert all(gpu_check_bench.GROUP % c.block_k == 0 for c in configs)
        splits = {c.split_k for c in configs}
        assert splits == {1} if m > 16 else len(splits) >= 2  # decode tries several K splits


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_the_cpu(tmp_path):
    """--dry-run: tiny models on the CPU, the kernels under the Triton interpreter; every step passes."""
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_WORK": str(tmp_path / "work"), "HOME": str(tmp_path)}
    start = time.time()
    result = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    seconds = time.time() - start
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    steps = summary["steps"]
    assert all(s["status"] == "ok" for s in steps.values()), {k: s["status"] for k, s in steps.items()}
    assert steps["install"]["result"]["install"]["figures"]["imported_from"].endswith("pkg")
    engines = steps["smoke"]["result"]["engines"]["figures"]
    assert engines["selfcheck"] == "all pass" and engines["auto_backend"] == "torch"  # the CPU: torch
    assert engines["logits_rel_err"] < 1e-4 and engines["greedy_identical"] == "4/4"  # float32: same function
    assert steps["kernels"]["result"]["kernels"]["figures"]["failed"] == 0
    parity = steps["parity"]["result"]["parity"]["figures"]
    assert parity["logits_rel_err"] < 1e-4 and parity["greedy_identical"] == "2/2"
    rows = steps["decode7b"]["result"]["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["tokens_per_s"] > 0 for r in rows)
    gptq = steps["gptq8"]["result"]["gptq"]["figures"]
    assert gptq["layers"] == 3 and gptq["s_per_block"] > 0 and gptq["estimate_32_layers_s"] > gptq["seconds"]
    assert not (tmp_path / "work" / "checkpoints" / "tiny-w4-rtn").exists()  # deleted after decode
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    assert "GPU check summary" in result.stdout and seconds < 300
    print(f"dry run: {seconds:.0f}s", file=sys.stderr)


def test_timed_runs_the_command_after_the_double_dash_and_measures_a_folder(tmp_path):
    folder = tmp_path / "made"
    make = f"import pathlib; p = pathlib.Path({str(folder)!r}); p.mkdir(); (p / 'f').write_bytes(bytes(10**6))"
    rc = gpu_check.main(["timed", str(tmp_path / "t.json"), "--size", str(folder), "--", sys.executable, "-c", make])
    figures = json.loads((tmp_path / "t.json").read_text())["figures"]
    assert rc == 0 and figures["rc"] == 0 and figures["mb"] == 1.0 and figures["seconds"] >= 0
    assert json.loads((tmp_path / "t.json").read_text())["command"][-2] == "-c"
    with pytest.raises(SystemExit, match="timed needs a command after --"):
        gpu_check.main(["timed", str(tmp_path / "u.json")])


def test_a_sweep_bucket_times_each_tile_checks_its_output_and_records_one_that_fails():
    """On the CPU through the Triton interpreter, with a stand-in timer (the sweep itself times on a GPU)."""
    import torch
    import triton  # noqa: F401 (the gpu extra, installed in CI)

    from benchmarks.bench_kernels import make_quant_weight
    from quantkit.runtime.kernels.quant_matmul import QuantMatmulConfig

    weight = make_quant_weight(64, 256, 4, gpu_check_bench.GROUP, "cpu")
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(0)).half()
    configs = [QuantMatmulConfig(16, 64, 128, 2), QuantMatmulConfig(16, 32, 64, 1), QuantMatmulConfig(16, 32, 24)]
    times = iter([0.02, 0.01])  # ms: the second tile is the faster

    def timer(fn):
        fn()
        return next(times)

    bucket = gpu_check_bench.time_bucket(1, x, weight, configs, timer, bound_ms=0.005, stop=time.time() + 120)
    rows = bucket["rows"]
    assert ["us" in r for r in rows] == [True, True, False]
    assert rows[1]["rel_err_vs_default"] < 1e-2 and rows[2]["error"].startswith("ValueError: block_k must be")
    assert bucket["figures"] == {"m1_default_us": 20.0, "m1_best": "10.0us 16x32x64 split 1 w4 (50% of bw)"}
    late = gpu_check_bench.time_bucket(1, x, weight, configs, timer, bound_ms=0.005, stop=time.time() - 1)
    assert late["rows"] == [] and late["figures"] == {"stopped": "at m=1: out of time"}
