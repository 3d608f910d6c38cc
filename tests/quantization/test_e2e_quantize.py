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


def test_a_newcomers_command_writes_a_checkpoint_every_engine_loads(smollm2_dir, tmp_path, capsys):
    """`quantkit quantize smollm2-135m -o out`, no scheme flags (rtn keeps it fast; the layout is every method's):
    the default g128 does not divide the 576 in-features of q/k/v/o/gate/up, so those get g64 and down_proj (1536)
    keeps g128, said in one line; every engine loads the result, transformers included."""
    from helpers.cli import run_cli
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", "smollm2-135m", "-o", str(out), "--method", "rtn"], capsys)
    assert code == 0, err
    notice = [line for line in err.splitlines() if "layout:" in line]
    assert len(notice) == 1 and "g128 -> g64 on 180 linears" in notice[0], err
    report = inspect_checkpoint(out, smollm2_dir)
    groups = {layer.name.split(".", 3)[-1]: layer.scheme for layer in report.layers}
    assert groups["mlp.down_proj"] == "w4-g128-sym" and groups["self_attn.q_proj"] == "w4-g64-sym"
    assert all(verdict.loads for verdict in report.loads_in)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.quantization_config is not None
