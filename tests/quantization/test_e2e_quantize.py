"""End to end on SmolLM2 with a small calibration set: GPTQ and AWQ beat round-to-nearest at W4."""

import json

import pytest

from quantkit.data.calibration import CalibrationConfig
from quantkit.eval.evaluate import EvalConfig, evaluate
from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.pipeline import quantize_model

pytestmark = pytest.mark.e2e
WINDOWS = 6


@pytest.fixture(scope="module")
def w4_results(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("w4")
    results = {}
    for method, sym in (("rtn", True), ("gptq", True), ("awq", False), ("rtn-asym", False)):
        out = root / method
        config = QuantizeConfig.for_method(
            method.removesuffix("-asym"),
            scheme=QuantScheme(bits=4, group_size=64, symmetric=sym),
            calibration=CalibrationConfig(num_samples=16, seq_len=256),
            show_progress=False,
        )
        quantize_model("smollm2-135m", config, out)
        against = EvalConfig(max_windows=WINDOWS, reference="smollm2-135m", show_progress=False)
        results[method] = (out, evaluate(out, against))
    results["fp"] = (smollm2_dir, evaluate("smollm2-135m", EvalConfig(max_windows=WINDOWS, show_progress=False)))
    return results


def test_gptq_w4_beats_rtn_w4(w4_results):
    fp, rtn, gptq = (w4_results[k][1] for k in ("fp", "rtn", "gptq"))
    assert rtn.perplexity > fp.perplexity * 1.05  # W4 g64 RTN really hurts this model
    assert gptq.perplexity < rtn.perplexity
    assert gptq.kl_mean < rtn.kl_mean


def test_awq_w4_beats_rtn_w4(w4_results):
    rtn, awq = w4_results["rtn-asym"][1], w4_results["awq"][1]
    assert awq.perplexity < rtn.perplexity
    assert awq.kl_mean < rtn.kl_mean


def test_checkpoint_metadata_and_size(w4_results, smollm2_dir):
    out = w4_results["gptq"][0]
    config = json.loads((out / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 64, True)
    report = inspect_checkpoint(out, smollm2_dir)
    assert len(report.layers) == 30 * 7
    assert report.avg_bits_per_weight == pytest.approx(4 + 16 / 64, abs=1e-9)
    assert report.checkpoint_bytes < 0.5 * (smollm2_dir / "model.safetensors").stat().st_size
