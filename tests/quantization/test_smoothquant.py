"""SmoothQuant: the factor formula, a fold that keeps the float block's function, an alpha search that picks the
lowest block-output error (and beats no smoothing where an input channel is an outlier), and a W8A8 checkpoint
whose logits are closer to the float model's than GPTQ alone; the method spelling, its option and its recipe key."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.tiny import save_tiny_model, tiny_llama
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.format.input_quant import fake_quantize_input
from quantkit.format.loader import load_quantized_model
from quantkit.format.presets import preset
from quantkit.model.architectures import arch_for_model_type
from quantkit.model.blocks import BlockRunner
from quantkit.quantization.methods.smoothquant import SmoothQuantConfig
from quantkit.quantization.methods.smoothquant_block import smooth_block
from quantkit.quantization.solvers.grid import quantize_rtn
from quantkit.quantization.solvers.smoothquant import (
    MAGNITUDE_FLOOR,
    alpha_grid,
    search_alpha,
    smoothing_scales,
    weight_absmax,
)
from quantkit.recipes.schema import RecipeError, recipe_from_text

LLAMA = arch_for_model_type("llama")
W8A8 = preset("W8A8")
OUTLIERS = {"input_layernorm": 3, "post_attention_layernorm": 7}  # norm -> the channel made an outlier
OUTLIER_GAIN = 40.0


def _with_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """Every block's norms with one channel ``OUTLIER_GAIN`` times larger: q/k/v and gate/up read an input whose
    one channel dwarfs the others, as the activations of trained LLMs do."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, channel in OUTLIERS.items():
                getattr(layer, norm).weight[channel] *= OUTLIER_GAIN
    return model


def _block_case(seed: int = 0) -> tuple[torch.nn.Module, BlockRunner, torch.Tensor]:
    """The first block of an outlier model, its runner and a calibration input (embeddings of random tokens)."""
    model = _with_outliers(tiny_llama(seed=seed))
    runner = BlockRunner.for_model(model, LLAMA, seq_len=32, batch_size=3)
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
    return model.model.layers[0], runner, hidden


def _all_w8a8() -> dict[str, object]:
    return dict.fromkeys(LLAMA.linears, W8A8)


# ---------------------------------------------------------------------------------------------------------- math


def test_factors_are_the_papers_formula_and_never_zero_or_infinite() -> None:
    x = torch.tensor([4.0, 1.0, 9.0, 0.0, 2.0])
    w = torch.tensor([1.0, 4.0, 0.25, 0.5, 0.0])
    s = smoothing_scales(x, w, 0.5)
    assert torch.allclose(s[:3], torch.tensor([2.0, 0.5, 6.0]))  # sqrt(x) / sqrt(w)
    assert s[3] == pytest.approx((MAGNITUDE_FLOOR / 0.5) ** 0.5)  # a dead input channel: floored, not 0
    assert s[4] == pytest.approx((2.0 / MAGNITUDE_FLOOR) ** 0.5)  # an all-zero weight column: floored, not inf
    assert torch.allclose(smoothing_scales(x[:3], w[:3], 1.0), x[:3])
    assert torch.allclose(smoothing_scales(x[:3], w[:3], 0.0), 1.0 / w[:3])
    assert bool(torch.isfinite(smoothing_scales(x, w, 0.0)).all()) and bool((smoothing_scales(x, w, 1.0) > 0).all())
    with pytest.raises(ValueError, match="alpha must be in"):
        smoothing_scales(x, w, 1.5)
    # the weight maximum runs over every row of every linear of the group
    w_max = weight_absmax([torch.tensor([[1.0, -5.0], [2.0, 0.0]]), torch.tensor([[-3.0, 1.0]])])
    assert w_max.tolist() == [3.0, 5.0]
    assert alpha_grid(4) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_the_search_keeps_no_smoothing_unless_an_alpha_is_strictly_better() -> None:
    rising = search_alpha([0.0, 0.5, 1.0], lambda a: 1.0 if a is None else 2.0 + a)
    assert rising.alpha is None and rising.error == rising.plain_error == 1.0
    valley = search_alpha([0.0, 0.5, 1.0], lambda a: 1.0 if a is None else (a - 0.5) ** 2 + 0.1)
    assert valley.alpha == 0.5 and valley.error == pytest.approx(0.1)
    assert [a for a, _ in valley.errors] == [0.0, 0.5, 1.0]


def test_the_fold_keeps_the_float_block_output() -> None:
    block, runner, hidden = _block_case()
    with torch.no_grad():
        before = runner(block, hidden).clone()
    norm = block.input_layernorm.weight.detach().clone()
    report = smooth_block(block, LLAMA, hidden, runner, _all_w8a8(), SmoothQuantConfig(alpha=0.5), torch.float32)
    # the tiny model has 2 KV heads for 4 query heads: v_proj -> o_proj cannot fold, the other three groups do
    assert [g.prev for g in report.groups] == ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"]
    assert [g.prev for g in report.skipped] == ["self_attn.v_proj"]
    assert report.search is None
    # the outlier channel's norm weight shrank by far the most: its input was divided by the largest factor
    ratio = norm / block.input_layernorm.weight.detach()
    assert int(ratio.argmax()) == OUTLIERS["input_layernorm"] and float(ratio.max()) > 5 * float(ratio.median())
    with torch.no_grad():
        after = runner(block, hidden)
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-5 * float(before.abs().max()))


# -------------------------------------------------------------------------------------------------------- search


def _quantized_block_error(block: torch.nn.Module, runner: BlockRunner, hidden: torch.Tensor, reference) -> float:
    """The block output error with every linear per-channel int8 and its input int8 per token, written here
    independently of the driver: each linear's weight replaced by its RTN, each input quantized by a hook."""
    block = copy.deepcopy(block)
    handles = []
    with torch.no_grad():
        for name in LLAMA.linears:
            linear = block.get_submodule(name)
            linear.weight.copy_(quantize_rtn(linear.weight, W8A8, scale_dtype=torch.float32).dequantize())
            hook = lambda _m, args: (fake_quantize_input(args[0], W8A8.activations, None),)  # noqa: E731
            handles.append(linear.register_forward_pre_hook(hook))
        out = runner(block, hidden)
    return float((out - reference).square().mean())


def test_the_search_picks_the_lowest_error_alpha_and_beats_no_smoothing_on_outliers() -> None:
    block, runner, hidden = _block_case()
    with torch.no_grad():
        reference = runner(block, hidden).clone()
    plain = _quantized_block_error(block, runner, hidden, reference)
    config = SmoothQuantConfig(search_samples=None)
    report = smooth_block(block, LLAMA, hidden, runner, _all_w8a8(), config, torch.float32)
    search = report.search
    assert search is not None and report.alpha is not None
    assert [a for a, _ in search.errors] == alpha_grid(config.grid)
    assert search.error == min(e for _, e in search.errors) and dict(search.errors)[report.alpha] == search.error
    # the errors the search measured are the block's: recomputed here without the driver, before and after
    assert search.plain_error == pytest.approx(plain, rel=1e-4)
    assert search.error == pytest.approx(_quantized_block_error(block, runner, hidden, reference), rel=1e-4)
    # an outlier channel costs per-token int8 inputs most of their resolution; smoothing wins a lot of it back
    assert search.error < 0.5 * search.plain_error
    # neither extreme is best: alpha trades the inputs' range against the weights'
    assert 0.0 < report.alpha < 1.0


@pytest.mark.parametrize(("name", "gain"), [("FP8_DYNAMIC", 0.6), ("NVFP4", 0.6), ("FP8", 1.0)])
def test_the_search_runs_on_the_float_presets_numerics(name: str, gain: float) -> None:
    """Per-token FP8 and NVFP4's groups of 16 gain from smoothing the outlier; FP8's static per-tensor weight scale
    does not here (scaled-up columns widen the one range every weight shares), and the search keeps it unsmoothed
    rather than lose."""
    block, runner, hidden = _block_case()
    schemes = dict.fromkeys(LLAMA.linears, preset(name))
    report = smooth_block(block, LLAMA, hidden, runner, schemes, SmoothQuantConfig(grid=5), torch.bfloat16)
    search = report.search
    assert search is not None and search.error == min([search.plain_error, *(e for _, e in search.errors)])
    assert search.error <= gain * search.plain_error


def test_a_weight_only_scheme_smooths_only_when_the_weight_error_drops() -> None:
    block, runner, hidden = _block_case()
    weight_only = dict.fromkeys(LLAMA.linears, preset("W4A16"))
    report = smooth_block(block, LLAMA, hidden, runner, weight_only, SmoothQuantConfig(grid=4), torch.float32)
    assert report.search is not None and report.search.error <= report.search.plain_error
    assert (report.alpha is None) == (report.groups == [])


# ------------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def outlier_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_tiny_model(tmp_path_factory.mktemp("outliers") / "model")
    model = _with_outliers(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    model.save_pretrained(path)
    return path


def _logit_error(model_dir: Path, checkpoint: Path, calib: Path) -> float:
    ids = load_file(str(calib))["input_ids"].long()
    float_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    quantized = load_quantized_model(checkpoint)
    with torch.inference_mode():
        return float((quantized(input_ids=ids).logits - float_model(input_ids=ids).logits).square().mean())


def test_w8a8_smoothquant_gptq_checkpoint_is_closer_to_the_float_model(
    outlier_model_dir: Path, tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--scheme", "W8A8", "--calib", str(tiny_calib_file), "--batch-size", "2"]
    errors = {}
    for method in ("gptq", "smoothquant+gptq"):
        out = tmp_path / method
        code, _, err = run_cli(
            ["quantize", str(outlier_model_dir), "-o", str(out), *common, "--method", method], capsys
        )
        assert code == 0, err
        errors[method] = _logit_error(outlier_model_dir, out, tiny_calib_file)
    assert errors["smoothquant+gptq"] < 0.3 * errors["gptq"], errors

    log = json.loads((tmp_path / "smoothquant+gptq" / "quantkit_log.json").read_text())
    assert log["method"] == "smoothquant+gptq"
    assert log["solvers"]["smoothquant"] == {"alpha": None, "grid": 10, "search_samples": 8}
    records = [r for r in log["layers"] if r.get("kind") == "smoothquant"]
    assert [r["name"] for r in records] == ["model.layers.0", "model.layers.1"]
    for record in records:
        assert record["alpha"] is not None and record["groups"] == 3
        assert record["smooth_error"] < record["plain_error"]


def test_a_fixed_alpha_from_the_command_line_and_a_bad_one(
    tiny_model_dir: Path, tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fixed"
    calib = ["--calib", str(tiny_calib_file)]
    args = ["quantize", str(tiny_model_dir), "--scheme", "W8A8", "--method", "smoothquant", *calib]
    code, _, err = run_cli([*args, "-o", str(out), "--smoothquant-alpha", "0.3"], capsys)
    assert code == 0, err
    log = json.loads((out / "quantkit_log.json").read_text())
    assert log["method"] == "smoothquant" and log["solvers"]["smoothquant"]["alpha"] == 0.3
    records = [r for r in log["layers"] if r.get("kind") == "smoothquant"]
    assert [(r["alpha"], r["plain_error"], r["groups"]) for r in records] == [(0.3, None, 3)] * 2

    code, _, err = run_cli([*args, "-o", str(tmp_path / "bad"), "--smoothquant-alpha", "1.5"], capsys)
    assert code == 2 and "SmoothQuant alpha must be in [0, 1]" in err
    assert not (tmp_path / "bad").exists()


def test_the_recipe_key() -> None:
    base = "model: m\noutput: {directory: o}\nquantization:\n  scheme: {preset: W8A8}\n  solvers: "
    recipe = recipe_from_text(base + "{smoothquant: {alpha: 0.6}, gptq: {}}\n", "r.yaml")
    configs = recipe.quantization.solver_configs()
    assert [type(c).__name__ for c in configs] == ["SmoothQuantConfig", "GPTQConfig"]  # run order: transform first
    assert configs[0] == SmoothQuantConfig(alpha=0.6)
    listed = recipe_from_text(base + "[smoothquant, gptq]\n", "r.yaml").quantization.solver_configs()
    assert SmoothQuantConfig() in listed  # the list form, llm-compressor's modifier list
    with pytest.raises(RecipeError, match=r"quantization\.solvers\.smoothquant.*alpha must be in \[0, 1\]"):
        recipe_from_text(base + "{smoothquant: {alpha: 2}, gptq: {}}\n", "r.yaml")
