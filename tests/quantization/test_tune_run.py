"""``--tune-steps`` in the layer-by-layer run: every block's output error never grows, the run resumes to the
same bytes, rotation and tuning combine, and bad values are refused before any work."""

import json

import pytest
import torch
from helpers.cli import run_cli

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.quantization.methods.tune import TuneConfig
from quantkit.quantization.pipeline import quantize_model

SCHEME = QuantScheme(bits=3, group_size=32)
TUNE = TuneConfig(steps=40, batch_windows=2)


def _config(calib, *algorithms, **fields) -> QuantizeConfig:
    algorithms = algorithms if any(isinstance(a, TuneConfig) for a in algorithms) else (*algorithms, TUNE)
    return QuantizeConfig.for_method(
        "gptq", *algorithms, scheme=SCHEME, calibration_file=calib, show_progress=False, batch_size=2, **fields
    )


def _tune_records(output) -> list[dict]:
    log = json.loads((output / "quantkit_log.json").read_text())
    return [r for r in log["layers"] if r.get("kind") == "tune"]


def test_tuning_never_raises_a_blocks_error_and_lowers_some(tiny_model_dir, tiny_calib_file, tmp_path):
    out = tmp_path / "tuned"
    quantize_model(str(tiny_model_dir), _config(tiny_calib_file, RotationConfig("hadamard")), out)
    records = _tune_records(out)
    assert [r["name"] for r in records] == ["model.layers.0", "model.layers.1"]
    assert all(r["loss_after"] <= r["loss_before"] and r["steps"] == TUNE.steps for r in records)
    assert any(r["kept"] and r["loss_after"] < 0.99 * r["loss_before"] for r in records)


def test_a_tuned_run_resumes_to_the_same_bytes(tiny_model_dir, tiny_calib_file, tmp_path):
    whole = tmp_path / "whole"
    quantize_model(str(tiny_model_dir), _config(tiny_calib_file), whole)

    def stop_after_first(index: int) -> None:
        if index == 0:
            raise KeyboardInterrupt

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(tiny_model_dir), _config(tiny_calib_file), resumed, on_block_done=stop_after_first)
    with pytest.raises(QuantkitError, match="method, scheme or solver options differ"):
        quantize_model(str(tiny_model_dir), _config(tiny_calib_file, TuneConfig(steps=3), resume=True), resumed)
    quantize_model(str(tiny_model_dir), _config(tiny_calib_file, resume=True), resumed)
    for name in ("model.safetensors", "quantkit_log.json"):
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name


def test_round_to_nearest_with_tuning_draws_calibration(tiny_model_dir, tiny_calib_file, tmp_path):
    config = QuantizeConfig.for_method(
        "rtn", TUNE, scheme=SCHEME, calibration_file=tiny_calib_file, show_progress=False
    )
    assert config.needs_calibration
    quantize_model(str(tiny_model_dir), config, tmp_path / "rtn-tuned")
    assert len(_tune_records(tmp_path / "rtn-tuned")) == 2


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--tune-steps", "-1", "--tune-steps must be >= 0"),
        ("--tune-lr", "0", "--tune-lr must be positive"),
        ("--tune-scale-lr", "-0.1", "--tune-scale-lr must be positive"),
        ("--tune-batch-windows", "0", "--tune-batch-windows must be >= 1"),
    ],
)
def test_cli_refuses_bad_tuning_options(tiny_model_dir, tiny_calib_file, tmp_path, capsys, flag, value, message):
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(tiny_calib_file), flag, value]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and message in " ".join(err.split())
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_tuning_targets_are_the_float_models_own_activations(tiny_model_dir, tiny_calib_file, tmp_path, monkeypatch):
    """Each block is tuned towards the float model's output (AutoRound's targets), not the float block's output on
    the quantized model's input, so later blocks make up for earlier blocks' error."""
    from transformers import AutoModelForCausalLM

    from quantkit.data.calibration import CalibrationSet
    from quantkit.quantization.methods import tune as module

    seen: list[tuple] = []
    real = module.tune_block

    def spy(block, runner, inputs, targets, *args, **kwargs):
        seen.append((inputs.clone(), targets.clone()))
        return real(block, runner, inputs, targets, *args, **kwargs)

    monkeypatch.setattr(module, "tune_block", spy)
    quantize_model(str(tiny_model_dir), _config(tiny_calib_file), tmp_path / "tuned")
    input_ids = CalibrationSet.load(tiny_calib_file).input_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    outputs = {}  # each block's output in the float model (hidden_states[-1] has the final norm applied)
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda _m, _i, out, index=index: outputs.setdefault(index + 1, out))
    with torch.inference_mode():
        states = model(input_ids, output_hidden_states=True).hidden_states
    (inputs0, _), (inputs1, targets1) = seen
    storage = inputs0.dtype
    assert torch.equal(inputs0, states[0].to(storage))  # block 0 reads the embeddings
    block1 = outputs[2][0] if isinstance(outputs[2], tuple) else outputs[2]
    torch.testing.assert_close(targets1.float(), block1.float(), atol=1e-5, rtol=1e-5)  # the float path (measured: 0)
    # block 1 reads the quantized model's activations (on them the float block is off by ~1e-2)
    assert (inputs1.float() - states[1].float()).abs().max() > 1e-3  # ... which differ from the float ones
