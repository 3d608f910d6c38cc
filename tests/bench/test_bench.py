"""`quantkit bench` on the tiny model: the JSON report, the Chrome trace, the HF comparison, the seeded workload
and one-line errors for bad engine options."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers.cli import run_cli

from quantkit.bench.report import percentile
from quantkit.bench.workload import copied_fraction, make_workload
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.step_profile import STAGES


def _bench(model: Path, tmp_path: Path, capsys, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "out.json"
    code, stdout, err = run_cli(["bench", str(model), "--json", str(out), *extra], capsys)
    assert code == 0, err
    return json.loads(out.read_text()), stdout


@pytest.mark.slow
def test_bench_reports_throughput_latency_memory_and_stages(tiny_model_dir, tmp_path, capsys):
    from quantkit.model.resolve import load_tokenizer

    report, stdout = _bench(tiny_model_dir, tmp_path, capsys, "--requests", "6", "--concurrency", "4")
    # the tiny model's context is 128 tokens: the workload the command must have run
    expected = make_workload(load_tokenizer(tiny_model_dir), 6, "free", seed=0, max_model_len=128)
    assert report["workload"] == {
        "kind": "free",
        "requests": 6,
        "seed": 0,
        "concurrency": 4,
        "prompt_tokens": sum(len(r.prompt) for r in expected),
        "max_tokens": sum(r.max_tokens for r in expected),
    }
    assert [r["prompt_tokens"] for r in report["per_request"]] == [len(r.prompt) for r in expected]
    assert all(0 < r["output_tokens"] <= q.max_tokens for r, q in zip(report["per_request"], expected, strict=True))
    for key in ("wall_s", "requests_per_s", "output_tokens", "output_tokens_per_s", "peak_rss_mb", "steps"):
        assert report[key] > 0, key
    for key in ("ttft_s", "tpot_s"):
        assert 0 < report[key]["p50"] <= report[key]["p95"], key
    kv = report["kv_cache"]
    assert 0 < kv["peak_usage"] <= 1 and 0 < kv["peak_tokens"] <= kv["capacity_tokens"]
    assert kv["peak_tokens"] % kv["block_size"] == 0
    stages = report["stages"]
    assert list(stages["seconds"]) == list(STAGES)
    assert stages["seconds"]["forward"] > 0 and stages["total_s"] <= report["wall_s"]
    assert report["speculation"] is None and report["hf"] is None and report["profile_trace"] is None
    assert len(report["per_request"]) == 6
    assert sum(r["output_tokens"] for r in report["per_request"]) == report["output_tokens"]
    assert report["engine"]["kv_cache_dtype"] == "auto"
    assert "output tokens/s" in stdout and "forward" in stdout


@pytest.mark.slow
def test_profile_writes_a_chrome_trace_with_labelled_steps(tiny_model_dir, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    report, _ = _bench(tiny_model_dir, tmp_path, capsys, "--requests", "2", "--profile", str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"engine.step", "engine.forward", "engine.schedule"} <= names
    assert report["profile_trace"] == str(trace) and report["stages"]["seconds"]["forward"] > 0


@pytest.mark.slow
def test_compare_hf_reports_a_ratio_and_identical_greedy_tokens(tiny_model_dir, tmp_path, capsys):
    report, stdout = _bench(tiny_model_dir, tmp_path, capsys, "--requests", "4", "--compare-hf", "--workload", "mixed")
    hf = report["hf"]
    assert hf["engine_over_hf"] > 0 and hf["output_tokens_per_s"] > 0 and hf["batch_size"] == 8
    assert hf["compared"] == 4 and hf["identical"] == 4  # fp32, greedy, the same weights
    assert "identical greedy tokens: 4/4" in stdout and "engine / HF" in stdout


@pytest.mark.slow
def test_speculation_reports_acceptance_and_tokens_per_step(tiny_model_dir, tmp_path, capsys):
    args = ("--requests", "3", "--workload", "copy", "--speculative", "ngram", "--num-speculative-tokens", "3")
    report, stdout = _bench(tiny_model_dir, tmp_path, capsys, *args)
    spec = report["speculation"]
    assert spec["drafted"] > 0 and 0 <= spec["acceptance_rate"] <= 1 and spec["tokens_per_step"] >= 1
    assert report["engine"]["speculative"] == "ngram" and "acceptance" in stdout


@pytest.mark.slow
def test_every_engine_option_reaches_the_engine(tiny_model_dir, tmp_path, capsys):
    args = ("--requests", "2", "--num-kv-blocks", "48", "--max-model-len", "96", "--no-enable-prefix-caching")
    report, _ = _bench(tiny_model_dir, tmp_path, capsys, *args, "--block-size", "8")
    want = EngineConfig(num_kv_blocks=48, max_model_len=96, enable_prefix_caching=False, block_size=8)
    assert report["engine"] == dataclasses.asdict(want)
    assert report["kv_cache"]["num_blocks"] == 48 and report["kv_cache"]["block_size"] == 8
    assert report["kv_cache"]["capacity_tokens"] == 48 * 8


def test_the_workload_is_fixed_by_its_seed_and_fits_the_context(tiny_model_dir):
    from quantkit.model.resolve import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    for kind in ("free", "copy", "mixed"):
        first = make_workload(tok, 8, kind, seed=3, max_model_len=128)
        assert first == make_workload(tok, 8, kind, seed=3, max_model_len=128)
        assert first != make_workload(tok, 8, kind, seed=4, max_model_len=128)
        assert all(len(r.prompt) + r.max_tokens <= 128 and r.max_tokens >= 1 for r in first)
        assert {r.kind for r in first} == ({"free", "copy"} if kind == "mixed" else {kind})


def test_copied_fraction_and_percentile():
    assert copied_fraction([1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 5, 9]) == pytest.approx(4 / 6)
    assert copied_fraction([1, 2, 3, 4], [1, 2, 3]) == 0.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([], 95) is None


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--kv-cache-dtype", "int4"], "kv_cache_dtype"),
        (["--num-speculative-tokens", "0", "--speculative", "ngram"], "num_speculative_tokens"),
        (["--workload", "chat"], "workload"),
        (["--concurrency", "0"], "concurrency"),
    ],
)
def test_bad_options_exit_2_with_one_line(tiny_model_dir, capsys, args, words):
    code, _, err = run_cli(["bench", str(tiny_model_dir), *args], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
