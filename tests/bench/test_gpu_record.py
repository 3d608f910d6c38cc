"""The GPU tables are recorded from the files a GPU check brought back (benchmarks/gpu/...): the recorded tables
equal what the recorder computes from those files, and the verdicts follow the goals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_record, record

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "benchmarks" / "gpu" / "h100-2026-11-27"


@pytest.fixture()
def recorded(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.chdir(REPO)  # the folder is named relative to the repository in the recorded command
    shipped = json.loads((REPO / "benchmarks" / "results" / "gpu_check.json").read_text())
    notes = [arg for note in shipped["notes"] for arg in ("--note", note)]
    assert gpu_record.main([str(FOLDER.relative_to(REPO)), "--date", "2026-11-27", *notes]) == 0
    return tmp_path


@pytest.mark.parametrize("name", ["gpu_kernels", "gpu_check"])
def test_the_shipped_gpu_tables_are_what_the_recorder_computes_from_the_shipped_files(recorded, name):
    shipped = json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())
    again = json.loads((recorded / f"{name}.json").read_text())
    assert again == shipped
    assert "H100" in shipped["machine"] and "no GPU" not in shipped["machine"]


def test_verdicts_follow_the_goals(recorded):
    kernels = json.loads((recorded / "gpu_kernels.json").read_text())
    verdict = {(r[0], r[1], r[2]): r[-1] for r in kernels["rows"]}
    assert verdict[("paged_attention", "H32/32 D128 ctx4096", "16")] == "met"  # 76% of the bandwidth
    assert verdict[("quant_matmul", "4096x11008 w4g128", "1")] == "missed"  # 0.83x torch
    assert verdict[("quant_matmul", "4096x11008 w4g128", "256")] == "-"  # no goal at prefill rows
    check = {r[0].split(",")[0]: r for r in json.loads((recorded / "gpu_check.json").read_text())["rows"]}
    assert check["GPTQ W4 g128 --device cuda"][-1] == "met"
    assert check["kernel tests on the GPU (tests/runtime/kernels"][1] == "98 passed, 0 failed"
    assert check["engine decode of the 7B-shape W4 model"][-1] == "not measured"


def test_a_folder_without_the_check_files_is_refused_with_what_it_needs(tmp_path):
    with pytest.raises(SystemExit, match=r"check\.json: missing"):
        gpu_record.main([str(tmp_path), "--date", "2026-11-27"])


def test_a_goal_met_reads_met():
    graph = {
        "rows": [
            {
                "kernel": "quant_matmul",
                "shape": "llama7b 4096x4096 w4g128",
                "m": 1,
                "triton_ms": 0.004,
                "torch_ms": 0.02,
                "speedup": 5.0,
                "bandwidth_fraction": 0.8,
            },
        ]
    }
    rows = gpu_record.kernel_rows(graph, {"rows": []})
    assert rows[0][3] == "-" and rows[0][-1] == "met"
