"""The real default model as llama.cpp's Q4_K_M, solved by GPTQ on 32 calibration windows: every tensor has the
type llama.cpp's quantize gives it (the table in test_mixes.py) and decodes to finite weights. About 2.3 minutes
of CPU time single-threaded (measured 2026-11-27: 1m55s user + 19s sys)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from quantkit.cli.app import app

from .test_mixes import expected

pytestmark = pytest.mark.e2e


def test_smollm2_q4_k_m_by_gptq(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "smollm2-q4_k_m.gguf"
    args = ["quantize", "smollm2-135m", "--format", "gguf:Q4_K_M", "-o", str(out), "--num-samples", "32"]
    result = CliRunner().invoke(app, [*args, "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    reader = gguf.GGUFReader(out)
    quantized = {t.name: t for t in reader.tensors if t.tensor_type.name != "F32"}
    assert {n: t.tensor_type.name for n, t in quantized.items()} == expected("Q4_K_M")
    assert all(np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all() for t in quantized.values())
    report = json.loads((tmp_path / "r.json").read_text())
    assert not any(t["fell_back_to_rtn"] for t in report["tensors"])
    assert 6.0 < report["file"]["bpw"] < 6.5 and report["file"]["file_bytes"] == out.stat().st_size
