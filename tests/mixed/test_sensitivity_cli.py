"""`quantkit sensitivity` with no --mode measures hybrid and prints the robust summary; `plan` compares with
the uniform schemes."""

from __future__ import annotations

import pytest
from helpers.cli import run_cli

from quantkit.mixed.measurement import load_measurement

pytestmark = pytest.mark.slow  # measures the tiny model (a few seconds)


def test_default_sensitivity_is_hybrid_and_plan_compares_with_uniform(tiny_model_dir, tmp_path, capsys):
    from helpers.paths import REPO

    from quantkit.data.calibration import CalibrationConfig, build_calibration

    text = tmp_path / "text.txt"
    text.write_text((REPO / "calibration" / "austen_persuasion_eval.txt").read_text()[:20000])
    calib = tmp_path / "calib.safetensors"
    config = CalibrationConfig(dataset=str(text), num_samples=4, seq_len=32, show_progress=False)
    build_calibration(str(tiny_model_dir), config, output=calib)
    out = tmp_path / "m.json"
    args = [
        "sensitivity",
        str(tiny_model_dir),
        "-o",
        str(out),
        "--calib",
        str(calib),
        "--candidates",
        "int4-g32,int8,fp16",
    ]
    code, stdout, err = run_cli(args, capsys)
    assert code == 0, err
    measurement = load_measurement(out)
    assert measurement.mode == "hybrid" and measurement.metadata["kl_windows"] == 2
    text = " ".join(stdout.split())
    assert "Sensitivity (hybrid)" in text and "median error" in text and "errors in KL, nats" in text

    code, stdout, err = run_cli(["plan", str(out), "--target-bits", "6", "-o", str(tmp_path / "p.yaml")], capsys)
    assert code == 0, err
    text = " ".join(stdout.split())
    assert "Plan vs uniform schemes (hybrid errors" in text and "this plan" in text and "int8" in text
    assert "proxy mode" not in err  # the note is for proxy measurements only
