"""The checks before any work on float presets, the FP8 KV cache and calibration: each bad job fails in one line
naming the layer (or the option) and the fix, exits 2 through the CLI, and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.tiny import save_tiny_model

from quantkit.errors import QuantkitError
from quantkit.format.presets import PRESETS
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.pipeline import quantize_model
from quantkit.quantization.scheme_checks import kv_observer_problem


def _refused(model: Path, tmp_path: Path, capsys, *args: str) -> str:
    """Quantize with ``args``; the run must exit 2 with one error line and write nothing."""
    out = tmp_path / "out"
    capsys.readouterr()  # what building the model printed
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "--method", "rtn", *args], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    return lines[0]


def test_nvfp4_on_in_features_not_a_multiple_of_16_names_the_layer_and_the_fix(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "m168", intermediate_size=168)  # down_proj: K = 168, even, not x16
    line = _refused(model, tmp_path, capsys, "--scheme", "NVFP4", "--layout-policy", "fallback")
    assert "model.layers.0.mlp.down_proj cannot hold nvfp4-g16" in line
    assert "group size 16 does not divide its 168 in-features" in line
    assert "--ignore" in line and "no layout policy changes it" in line


def test_fp8_block_needs_k_a_multiple_of_128(tiny_model_dir, tmp_path, capsys):
    line = _refused(tiny_model_dir, tmp_path, capsys, "--scheme", "FP8_BLOCK")  # hidden 64
    assert "model.layers.0.self_attn.q_proj cannot hold fp8-b128" in line and "its 64 in-features" in line


def test_a_kv_cache_the_observer_cannot_hook_is_refused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from transformers.models.llama import modeling_llama

    assert kv_observer_problem("llama") is None
    assert "no modeling module" in kv_observer_problem("not_a_model_type")
    # an architecture whose attention does not dispatch through ALL_ATTENTION_FUNCTIONS
    monkeypatch.delattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS")
    line = _refused(tiny_model_dir, tmp_path, capsys, "--scheme", "FP8_DYNAMIC", "--kv-cache-scheme", "fp8")
    assert "--kv-cache-scheme fp8: the llama attention does not dispatch" in line and "drop --kv-cache-scheme" in line


def _no_data(**fields) -> QuantizeConfig:
    return QuantizeConfig.for_method("rtn", calibration=None, **fields)


def test_a_static_input_scale_without_calibration_data_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(QuantkitError, match=r"static input scales .* give --calib FILE .* such as FP8_DYNAMIC"):
        quantize_model(tiny_model_dir, _no_data(scheme=PRESETS["FP8"]), out)
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(QuantkitError, match="NVFP4's global input scale"):
        _no_data(scheme=PRESETS["NVFP4"]).validate()


def test_without_calibration_data_a_data_free_job_passes_and_the_others_are_named():
    _no_data(scheme=PRESETS["FP8_DYNAMIC"]).validate()  # dynamic inputs, round-to-nearest: needs no windows
    _no_data(scheme=PRESETS["NVFP4A16"]).validate()
    with pytest.raises(QuantkitError, match="--kv-cache-scheme fp8 calibrates k/v scales"):
        _no_data(scheme=PRESETS["FP8_DYNAMIC"], kv_cache_scheme="fp8").validate()
    with pytest.raises(QuantkitError, match=r"gptq reads calibration activations .* data-free method rtn"):
        QuantizeConfig.for_method("gptq", calibration=None).validate()
    # a calibration file is calibration data
    QuantizeConfig.for_method("rtn", calibration=None, calibration_file=Path("c"), scheme=PRESETS["FP8"]).validate()
