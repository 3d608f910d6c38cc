"""A plan mixing float and integer candidates, end to end: `sensitivity` -> `plan` -> `quantize --plan` writes a
mixed-precision checkpoint whose stored bits are the measured ones, and which transformers (through
compressed-tensors) and quantkit's loader run to equal logits; a fused projection split between a float and an
integer scheme is refused before anything is written.

The model is bfloat16, as the default model is: transformers keeps NVFP4 and MX weights decompressed in bfloat16
(a float32 or float16 run of such a checkpoint fails there with a dtype mismatch, uniform presets alike), and with
bfloat16 scales its integer layers dequantize to the same bfloat16 values as quantkit's, so the logits are equal,
not close."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import run_cli

from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.loader import load_quantized_model
from quantkit.mixed.measurement import load_measurement

pytestmark = pytest.mark.slow

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 250, 11]])
CANDIDATES = "nvfp4,int4-g64,fp8,fp16"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from helpers.tiny import build_word_tokenizer, tiny_llama

    path = tmp_path_factory.mktemp("float_plan") / "model"
    # in-features 64 and 128: NVFP4's 16, MX's 32 and int4's 64 all divide them
    model = tiny_llama(seed=0, bos_token_id=1, eos_token_id=2, intermediate_size=128).to(torch.bfloat16)
    model.save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def calib(model_dir: Path) -> Path:
    from helpers.paths import REPO

    from quantkit.data.calibration import CalibrationConfig, build_calibration

    text = model_dir.parent / "text.txt"
    text.write_text((REPO / "calibration" / "austen_persuasion_eval.txt").read_text()[:20000])
    out = model_dir.parent / "calib.safetensors"
    config = CalibrationConfig(dataset=str(text), num_samples=4, seq_len=32, show_progress=False)
    build_calibration(str(model_dir), config, output=out)
    return out


@pytest.fixture(scope="module")
def measured(model_dir: Path, calib: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("float_sens") / "m.json"
    from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity

    config = SensitivityConfig(
        candidates=CANDIDATES.split(","), mode="proxy", calibration_file=calib, show_progress=False
    )
    measure_sensitivity(model_dir, config, out)
    return out


def test_float_candidates_are_measured_on_their_grids(measured: Path) -> None:
    m = load_measurement(measured)
    assert m.candidates == CANDIDATES.split(",")
    for unit in m.units:
        o = unit.options
        assert set(o) == set(m.candidates)  # every layout fits these in-features
        assert o["fp16"].error == 0.0 and 0 < o["fp8"].error < o["nvfp4"].error
        assert o["int4-g64"].bits < o["nvfp4"].bits < o["fp8"].bits < o["fp16"].bits


def test_a_mixed_nvfp4_int4_plan_loads_in_transformers_with_equal_logits(
    model_dir: Path, calib: Path, measured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.yaml"
    pins = ["--pin", r"layers\.0\.=nvfp4", "--pin", r"layers\.1\.=int4-g64"]
    code, _, err = run_cli(["plan", str(measured), "--target-bits", "16", "-o", str(plan), *pins], capsys)
    assert code == 0, err
    out = tmp_path / "ckpt"
    args = ["quantize", str(model_dir), "-o", str(out), "--plan", str(plan), "--calib", str(calib)]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    formats = sorted(group["format"] for group in config["config_groups"].values())
    assert formats == ["nvfp4-pack-quantized", "pack-quantized"]

    # stored bits: each unit's, as measured, and the plan's total
    report = inspect_checkpoint(out)
    stored = {layer.name: layer.bytes * 8 for layer in report.layers}
    schemes = {layer.name: layer.scheme for layer in report.layers}
    for unit in load_measurement(measured).units:
        chosen = "nvfp4" if ".layers.0." in unit.name else "int4-g64"
        assert sum(stored[m] for m in unit.modules) == unit.options[chosen].bits, unit.name
        layout = "nvfp4-g16-" if chosen == "nvfp4" else "w4-g64-sym-"  # then the solver's options
        assert all(schemes[m].startswith(layout) for m in unit.modules), unit.name
    totals = yaml.safe_load(plan.read_text())["totals"]
    assert sum(stored.values()) == totals["bits"]

    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ours = load_quantized_model(out, dtype=torch.bfloat16)(TOKENS).logits.float()
        theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()(TOKENS).logits.float()
    assert torch.equal(ours, theirs), f"max |diff| {float((ours - theirs).abs().max()):.3g}"


def test_a_fused_projection_split_between_float_and_int_is_refused(
    model_dir: Path, calib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM serves q/k/v as one matrix with one kernel, so they cannot hold NVFP4 and int4 at once."""
    plan = tmp_path / "plan.yaml"
    rules = [
        {"target": "re:.*self_attn\\.q_proj$", "scheme": "nvfp4"},
        {"target": "re:.*self_attn\\.(k_proj|v_proj)$", "scheme": "int4-g64"},
    ]
    plan.write_text(yaml.safe_dump({"model": str(model_dir), "rules": rules}))
    out = tmp_path / "ckpt"
    args = ["quantize", str(model_dir), "-o", str(out), "--plan", str(plan), "--calib", str(calib)]
    code, _, err = run_cli(args, capsys)
    text = " ".join(err.split())
    assert code == 2
    assert "fused modules must share one scheme" in text and "q_proj: nvfp4" in text and "k_proj: int4-g64" in text
    assert "give them the same scheme" in text
    assert len([line for line in err.strip().splitlines() if line.startswith("error")]) == 1
    assert not out.exists()
