"""On the CPU, ``--device`` changes nothing: a tiny random model quantized without the flag, with ``--device cpu``
and with ``--device auto`` (where auto resolves to the CPU) gives the same checkpoint bytes; the run log names
no device for a CPU run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli

from quantkit.eval.evaluate import EvalConfig, evaluate


def _checkpoint_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_the_checkpoint_is_byte_identical_with_and_without_device_cpu(
    method: str, tiny_model_dir, tiny_calib_file, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # auto is the CPU, on any machine
    outputs = {}
    for flag in ([], ["--device", "cpu"], ["--device", "auto"]):
        out = tmp_path / ("default" if not flag else flag[1])
        args = ["quantize", str(tiny_model_dir), "-o", str(out), "--method", method, "--group-size", "32"]
        code, stdout, err = run_cli([*args, "--calib", str(tiny_calib_file), "--batch-size", "3", *flag], capsys)
        assert code == 0, err
        assert "(on cpu)" in " ".join(stdout.split())
        outputs[out.name] = _checkpoint_bytes(out)
    default = outputs["default"]
    assert {"model.safetensors", "config.json", "quantkit_log.json"} <= set(default)
    assert outputs["cpu"] == default and outputs["auto"] == default
    assert "device" not in json.loads(default["quantkit_log.json"])


@pytest.mark.slow
def test_eval_on_device_cpu_gives_the_same_figures(tiny_model_dir, tiny_calib_file) -> None:
    text = tiny_calib_file.with_name("text.txt")
    reference = str(tiny_model_dir)
    config = EvalConfig(dataset=str(text), seq_len=32, max_windows=6, reference=reference, show_progress=False)
    default = evaluate(tiny_model_dir, config)
    config.device = "cpu"
    on_cpu = evaluate(tiny_model_dir, config)
    assert on_cpu.perplexity == default.perplexity and on_cpu.kl_mean == default.kl_mean == 0.0
