"""Can transformers load quantkit's mixture-of-experts checkpoints, whose routed experts are quantized per expert
(``mlp.experts.<e>.gate_proj.weight_packed``; Mixtral ``block_sparse_moe.experts.<e>.w1.*``)?

transformers 5 fuses the experts into 3-D parameters on load (``conversion_mapping.py``: ``"qwen2_moe"``, which
``qwen3_moe`` maps to, and ``"mixtral"``: ``MergeModulelist`` + ``Concatenate``). For a compressed-tensors checkpoint
``HfQuantizer.update_weight_conversions`` (``quantizers/base.py``) makes those converters also collect each expert's
``serialized_names`` (``quantizer_compressed_tensors.py``: ``weight_packed``, ``weight_scale``, ``weight_shape``; for
FP8 ``weight`` and ``weight_scale``) and run ``CompressedTensorsDequantize`` (``integrations/compressed_tensors.py``)
before the merge. So transformers loads the experts dequantized to the model's dtype and runs them unquantized:

- symmetric integer experts load, and the logits equal quantkit's loader's exactly;
- asymmetric ones fail: ``weight_zero_point`` is not collected (reported unexpected) and the dequantizer's stand-in
  module has none, so compressed-tensors asserts "Asymmetric quant requires zero-point values" and
  ``from_pretrained`` raises;
- FP8 experts load with the right weights, but their inputs are no longer quantized (a static ``input_scale`` is
  reported unexpected): the logits equal quantkit's only once quantkit's experts skip input quantization too;
- NVFP4 experts load wrong: ``weight_global_scale`` is not collected, so each expert's weight comes out multiplied
  by its global scale.

Each test asserts what happens today, so it fails the day transformers changes it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers.moe import NUM_EXPERTS, save_tiny_moe
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from quantkit.format.presets import PRESETS
from quantkit.format.quant_linear import QuantLinear
from quantkit.model.resolve import arch_for_dir, load_model
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import JobSteps, parse_method, resolve_scheme
from quantkit.quantization.pipeline import quantize_model

pytestmark = pytest.mark.slow

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 250, 11]])
LEAVES = ("gate", "up", "down")  # the three projections of an expert, in MoESpec.expert_linears order


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-transformers")
    return {family: save_tiny_moe(root / family, family) for family in ("qwen3_moe", "mixtral")}


@pytest.fixture(scope="module")
def quantized(moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """Quantize a tiny MoE with a preset (RTN; the calibration file gives FP8 its static input scales), once each."""
    made: dict[tuple[str, str], Path] = {}

    def make(family: str, preset: str) -> Path:
        if (family, preset) not in made:
            steps = parse_method("rtn")
            scheme = resolve_scheme(JobSteps(steps).scheme_defaults(), PRESETS[preset])
            if not scheme.is_float:  # hidden size 128 and expert width 64: groups of 32 fit both
                scheme = dataclasses.replace(scheme, group_size=32)
            config = QuantizeConfig(solvers=steps, scheme=scheme, calibration_file=tiny_calib_file, show_progress=False)
            out = tmp_path_factory.mktemp(f"{family}-{preset}") / "q"
            quantize_model(moe_dirs[family], config, out)
            made[family, preset] = out
        return made[family, preset]

    return make


def _load_hf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict[str, set[str]]]:
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    return model.eval(), info


def _expert_weights(path: Path, quantkit_model: torch.nn.Module, layer: int, expert: int) -> list[torch.Tensor]:
    """quantkit's dequantized gate, up and down weights of one expert."""
    moe = quantkit_model.model.layers[layer].get_submodule(arch_for_dir(path).mlp_path)
    return [linear.dense_weight() for linear in moe.expert_modules()[expert].projections]


def _fused(hf_model: torch.nn.Module, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    experts = hf_model.model.layers[layer].mlp.experts  # transformers 5 keeps Mixtral's MoE under .mlp too
    return experts.gate_up_proj[expert].float(), experts.down_proj[expert].float()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=TOKENS).logits.float()


def _assert_same_experts(path: Path, hf_model: torch.nn.Module, quantkit_model: torch.nn.Module) -> None:
    """transformers' fused expert tensors are quantkit's dequantized expert weights, bit for bit."""
    for layer in range(2):
        for expert in range(NUM_EXPERTS):
            gate, up, down = _expert_weights(path, quantkit_model, layer, expert)
            gate_up, fused_down = _fused(hf_model, layer, expert)
            assert torch.equal(torch.cat([gate, up]), gate_up) and torch.equal(down, fused_down)


def _assert_same_logits(hf_logits: torch.Tensor, quantkit_logits: torch.Tensor) -> None:
    """Equal up to float32 rounding: transformers sums the routed experts' outputs in another order than quantkit's
    per-expert loop (about 1e-6 on logits of magnitude 3)."""
    torch.testing.assert_close(hf_logits, quantkit_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("family", "preset"), [("qwen3_moe", "W4A16"), ("mixtral", "W4A16"), ("qwen3_moe", "W8A16")])
def test_symmetric_integer_experts_load_dequantized_with_quantkits_logits(family: str, preset: str, quantized) -> None:
    path = quantized(family, preset)
    hf_model, info = _load_hf(path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    experts = hf_model.model.layers[0].mlp.experts
    # dequantized at load: one dense float tensor per projection kind, no packed weights kept
    config = hf_model.config
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shape = (NUM_EXPERTS, 2 * expert_width, config.hidden_size)
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape == shape
    assert not any("packed" in name for name, _ in experts.named_parameters())
    quantkit_model = load_model(path)
    _assert_same_experts(path, hf_model, quantkit_model)
    _assert_same_logits(_logits(hf_model), _logits(quantkit_model))


def test_asymmetric_experts_fail_for_want_of_zero_points(quantized, caplog: pytest.LogCaptureFixture) -> None:
    path = quantized("qwen3_moe", "W4A16_ASYM")
    hf_logging.enable_propagation()  # transformers' loading report goes to its own logger
    try:
        with pytest.raises(RuntimeError, match="issues during automatic conversion of the weights"):
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.disable_propagation()
    assert "Asymmetric quant requires zero-point values" in caplog.text  # compressed-tensors' decompressor
    assert "CompressedTensorsDequantize" in caplog.text
    assert "weight_zero_point" in caplog.text and "UNEXPECTED" in caplog.text
    assert torch.isfinite(_logits(load_model(path))).all()  # quantkit's loader reads the checkpoint


@pytest.mark.parametrize(("family", "preset"), [("qwen3_moe", "FP8"), ("mixtral", "FP8_DYNAMIC")])
def test_fp8_experts_load_with_right_weights_but_unquantized_inputs(family: str, preset: str, quantized) -> None:
    path = quantized(family, preset)
    hf_model, info = _load_hf(path)
    static = PRESETS[preset].activations.dynamic is False
    expected_unexpected = {
        f"model.layers.{i}.{arch_for_dir(path).mlp_path}.experts.{e}.{leaf}.input_scale"
        for i in range(2)
        for e in range(NUM_EXPERTS)
        for leaf in arch_for_dir(path).moe.expert_linears
    }
    assert set(info["unexpected_keys"]) == (expected_unexpected if static else set())
    quantkit_model = load_model(path)
    _assert_same_experts(path, hf_model, quantkit_model)
    hf_logits = _logits(hf_model)
    assert (hf_logits - _logits(quantkit_model)).abs().max() > 1e-3  # quantkit quantizes expert inputs, as vLLM
    for name, module in quantkit_model.named_modules():
        if isinstance(module, QuantLinear) and ".experts." in name:
            module.scheme = dataclasses.replace(module.scheme, activations=None)
    _assert_same_logits(hf_logits, _logits(quantkit_model))


def test_nvfp4_experts_load_scaled_by_their_dropped_global_scale(quantized) -> None:
    path = quantized("qwen3_moe", "NVFP4A16")
    hf_model, info = _load_hf(path, torch.bfloat16)  # transformers keeps FP4 experts in bfloat16
    assert set(info["unexpected_keys"]) == {
        f"model.layers.{i}.mlp.experts.{e}.{leaf}_proj.weight_global_scale"
        for i in range(2)
        for e in range(NUM_EXPERTS)
        for leaf in LEAVES
    }
    quantkit_model = load_model(path)
    moe = quantkit_model.model.layers[0].mlp
    global_scale = moe.expert_modules()[0].projections[0].weight_global_scale.float()
    gate = _expert_weights(path, quantkit_model, 0, 0)[0]
    hf_gate = _fused(hf_model, 0, 0)[0][: gate.shape[0]]
    assert global_scale.item() > 100  # the stored FP8 scales are the effective ones times this
    torch.testing.assert_close(hf_gate, gate * global_scale, rtol=1e-2, atol=1e-3)
    assert (_logits(hf_model) - _logits(quantkit_model)).abs().max() > 0.5
