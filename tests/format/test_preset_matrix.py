"""The preset matrix: every compressed-tensors preset quantkit writes, quantized by the real pipeline on a tiny model,
loaded by transformers through the compressed-tensors package, gives the logits quantkit's own loader gives.

Equal, not close, wherever both compute the same numbers: float32 for the integer and FP8 presets, bfloat16 for the
FP4 and MX presets (transformers keeps their decompressed weights in bfloat16, so a float32 model fails there with
a dtype mismatch). Two presets quantize inputs differently in transformers than in the serving kernel quantkit
follows, each checked against its stated reason:

- W8A8 (int8 inputs per token): vLLM's kernel scales each token by ``absmax / 127``, compressed-tensors' emulation
  by ``absmax / 127.5`` (half its integer range); with that one constant swapped the logits are equal;
- NVFP4 (FP4 inputs in groups of 16): compressed-tensors computes the input's group scales in the model's
  bfloat16, the kernel (and quantkit) in float32; the two differ by no more than quantkit's own bfloat16 run
  differs from its float32 run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.format import input_quant
from quantkit.format.loader import load_quantized_model
from quantkit.format.presets import PRESETS
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import JobSteps, parse_method, resolve_scheme
from quantkit.quantization.pipeline import quantize_model

pytestmark = pytest.mark.slow

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 250, 11]])
FLOAT32_EQUAL = ("W2A16", "W3A16", "W4A16", "W4A16_ASYM", "W8A16", "W4AFP8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK")
BFLOAT16_EQUAL = ("NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8")
STATED = ("W8A8", "INT8", "NVFP4")
CT_INT8_RANGE = 127.5  # compressed-tensors' symmetric int8 scale divisor: (q_max - q_min) / 2


def test_the_matrix_names_every_preset():
    assert sorted((*FLOAT32_EQUAL, *BFLOAT16_EQUAL, *STATED)) == sorted(PRESETS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from helpers.tiny import save_tiny_model

    # in-features 128 and 256: every preset's groups (16, 32, 128) and FP8_BLOCK's 128 x 128 tiles divide them;
    # k/v have 64 rows, half a tile, so block scales start a tile per linear
    return save_tiny_model(tmp_path_factory.mktemp("presets") / "model", hidden_size=128, intermediate_size=256)


def _quantize(model_dir: Path, calib: Path, out: Path, preset: str, method: str = "rtn", kv: str | None = None) -> Path:
    steps = parse_method(method)
    scheme = resolve_scheme(JobSteps(steps).scheme_defaults(), PRESETS[preset])
    config = QuantizeConfig(
        solvers=steps, scheme=scheme, calibration_file=calib, kv_cache_scheme=kv, show_progress=False
    )
    quantize_model(model_dir, config, out)
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _ours(checkpoint: Path, dtype: torch.dtype) -> torch.Tensor:
    return _logits(load_quantized_model(checkpoint, dtype=dtype))


def _theirs(checkpoint: Path, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return _logits(AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).eval())


def _assert_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(ours, theirs), f"max |diff| {float((ours - theirs).abs().max()):.3g}"


@pytest.mark.parametrize("preset", FLOAT32_EQUAL)
def test_float32_presets_load_in_transformers_with_equal_logits(model_dir, tiny_calib_file, tmp_path, preset):
    out = _quantize(model_dir, tiny_calib_file, tmp_path / preset, preset)
    _assert_equal(_ours(out, torch.float32), _theirs(out, torch.float32))


@pytest.mark.parametrize("preset", BFLOAT16_EQUAL)
def test_fp4_and_mx_presets_load_in_transformers_with_equal_logits(model_dir, tiny_calib_file, tmp_path, preset):
    out = _quantize(model_dir, tiny_calib_file, tmp_path / preset, preset)
    _assert_equal(_ours(out, torch.bfloat16), _theirs(out, torch.bfloat16))


@pytest.mark.parametrize("preset", ["W8A8", "INT8"])
def test_w8a8_differs_from_transformers_only_by_the_int8_range_convention(
    model_dir, tiny_calib_file, tmp_path, monkeypatch, preset
):
    out = _quantize(model_dir, tiny_calib_file, tmp_path / preset, preset)
    theirs = _theirs(out, torch.float32)
    assert not torch.equal(_ours(out, torch.float32), theirs)  # vLLM's absmax / 127 is not compressed-tensors'
    element_max = input_quant._element_max
    monkeypatch.setattr(
        input_quant, "_element_max", lambda acts: CT_INT8_RANGE if acts.type == "int" else element_max(acts)
    )
    _assert_equal(_ours(out, torch.float32), theirs)


def test_nvfp4_differs_from_transformers_by_less_than_bfloat16_rounding(model_dir, tiny_calib_file, tmp_path):
    out = _quantize(model_dir, tiny_calib_file, tmp_path / "NVFP4", "NVFP4")
    ours, ours_float32 = _ours(out, torch.bfloat16), _ours(out, torch.float32)
    theirs = _theirs(out, torch.bfloat16)
    allowed = float((ours - ours_float32).abs().max())
    assert 0 < float((ours - theirs).abs().max()) <= allowed


@pytest.mark.parametrize("kv", ["fp8", "fp8-head"])
def test_an_fp8_kv_cache_loads_in_transformers_with_equal_logits(model_dir, tiny_calib_file, tmp_path, kv):
    out = _quantize(model_dir, tiny_calib_file, tmp_path / kv, "FP8", kv=kv)
    ours = _ours(out, torch.float32)
    _assert_equal(ours, _theirs(out, torch.float32))
    without_kv = _quantize(model_dir, tiny_calib_file, tmp_path / f"{kv}-none", "FP8")
    assert not torch.equal(ours, _ours(without_kv, torch.float32))  # the cache's FP8 rounding is applied


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [("FP8", torch.float32), ("W8A8", None), ("NVFP4A16", torch.bfloat16), ("MXFP4A16", torch.bfloat16)],
)
def test_gptq_solves_on_each_float_and_int8_grid(model_dir, tiny_calib_file, tmp_path, preset, dtype):
    """GPTQ's checkpoint loads everywhere as RTN's does, and its output is closer to the float model's than RTN's
    on the calibration text's own tokens."""
    gptq = _quantize(model_dir, tiny_calib_file, tmp_path / "gptq", preset, method="gptq")
    rtn = _quantize(model_dir, tiny_calib_file, tmp_path / "rtn", preset, method="rtn")
    if dtype is not None:
        _assert_equal(_ours(gptq, dtype), _theirs(gptq, dtype))
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tokens = load_file(str(tiny_calib_file))["input_ids"].long()
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()(tokens).logits
        errors = {}
        for name, path in (("gptq", gptq), ("rtn", rtn)):
            errors[name] = float((load_quantized_model(path)(tokens).logits - reference).pow(2).mean())
    assert errors["gptq"] < errors["rtn"], errors
