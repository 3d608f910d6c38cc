"""SmoothQuant in mixture-of-experts blocks: the post-attention norm's factors scale the columns of every reader of
the norm (router and shared-expert gate included, both kept in float), each expert's up -> down pair is a group
where the activation lets the factors through, the fold keeps the float block's output and its routing, a routed
expert no token reaches is left unsmoothed under routed calibration, and a W8A8 checkpoint of a model with outlier
channels is closer to the float model than GPTQ alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.family_checks import relative_error
from helpers.gpt_oss import tiny_gpt_oss
from helpers.moe import tiny_moe
from helpers.qwen3_5_moe import tiny_qwen3_5_moe
from helpers.tiny import build_word_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from quantkit.format.presets import preset
from quantkit.model.architectures import ArchSpec, arch_for_config
from quantkit.model.blocks import BlockRunner
from quantkit.model.moe import unfuse_experts
from quantkit.model.resolve import load_model
from quantkit.quantization.methods.smoothquant import SmoothQuantConfig
from quantkit.quantization.methods.smoothquant_block import smooth_block

W8A8 = preset("W8A8")
OUTLIERS = {"input_layernorm": 3, "post_attention_layernorm": 7}  # norm -> the channel made an outlier
GAIN = 40.0


def _with_outliers(model: PreTrainedModel) -> PreTrainedModel:
    """One channel of every block's norms ``GAIN`` times larger, as the activations of trained LLMs have them."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, channel in OUTLIERS.items():
                getattr(layer, norm).weight[channel] *= GAIN
    return model


def _model(family: str, unused: tuple[int, ...] = ()) -> PreTrainedModel:
    if family == "gpt_oss":
        return tiny_gpt_oss()
    if family == "qwen3_5_moe":
        return tiny_qwen3_5_moe(initializer_range=0.02)
    return _with_outliers(tiny_moe(family, unused_experts=unused))


def _block_case(family: str, unused: tuple[int, ...] = ()):
    model = _model(family, unused)
    arch = arch_for_config(model.config.to_dict())
    unfuse_experts(model, arch)
    runner = BlockRunner.for_model(model, arch, seq_len=16, batch_size=3)
    with torch.no_grad():
        hidden = model.model.embed_tokens(torch.randint(3, 256, (6, 16), generator=torch.Generator().manual_seed(1)))
    return model.model.layers[0], arch.for_layer(0), runner, hidden


def _routing(block: torch.nn.Module, arch: ArchSpec, runner: BlockRunner, hidden: torch.Tensor):
    """The block's output and each token's chosen experts."""
    chosen = []
    moe = block.get_submodule(arch.mlp_path)
    handle = moe.register_forward_pre_hook(lambda _m, args: chosen.append(moe.route(args[0].flatten(0, -2))[1]))
    with torch.no_grad():
        out = runner(block, hidden).clone()
    handle.remove()
    return out, torch.cat(chosen)


# family -> expert up -> down groups (gpt_oss's clamped SwiGLU lets no factor through)
FAMILIES = {"qwen3_moe": 8, "mixtral": 8, "qwen2_moe": 9, "gpt_oss": 0, "qwen3_5_moe": 9}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fold_scales_every_reader_of_the_norm_and_keeps_the_block(family: str) -> None:
    block, arch, runner, hidden = _block_case(family)
    before, routing_before = _routing(block, arch, runner, hidden)
    norm = block.get_submodule(arch.norms[1]).weight.detach().clone()
    readers = [name for name in arch.float_linears if name.startswith(f"{arch.mlp_path}.")]  # router, shared gate
    floats = {name: block.get_submodule(name).weight.detach().clone() for name in readers}
    schemes = dict.fromkeys(arch.linears, W8A8)
    report = smooth_block(block, arch, hidden, runner, schemes, SmoothQuantConfig(alpha=0.5), torch.float32)
    mlp_group = next(g for g in report.groups if g.prev == arch.norms[1])
    assert set(mlp_group.linears) == {*arch.stage("gate_up").linears, *readers} and readers  # router included
    assert len([g for g in report.groups if ".experts." in g.prev or "shared_expert." in g.prev]) == FAMILIES[family]
    # the router (and the shared expert's gate) took the norm's factors on their columns: W * s with s = old / new
    factors = (norm + arch.norm_offset) / (block.get_submodule(arch.norms[1]).weight.detach() + arch.norm_offset)
    assert float((factors - 1).abs().max()) > 0.1  # a real smoothing, which an unscaled router would not survive
    for name, weight in floats.items():
        torch.testing.assert_close(block.get_submodule(name).weight.detach(), weight * factors, rtol=1e-4, atol=1e-6)
    after, routing_after = _routing(block, arch, runner, hidden)
    assert torch.equal(routing_after, routing_before)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5 * float(before.abs().max()))


def test_routed_calibration_leaves_an_expert_no_token_reaches_unsmoothed() -> None:
    unused = (6, 7)
    expert_groups = {}
    for mode in ("all", "routed"):
        block, arch, runner, hidden = _block_case("qwen3_moe", unused)
        routed = set(_routing(block, arch, runner, hidden)[1].unique().tolist())
        schemes = dict.fromkeys(arch.linears, W8A8)
        config = SmoothQuantConfig(alpha=0.5)
        report = smooth_block(block, arch, hidden, runner, schemes, config, torch.float32, mode)
        expert_groups[mode] = {int(g.prev.split(".")[2]) for g in report.groups if ".experts." in g.prev}
        skipped = {int(g.prev.split(".")[2]) for g in report.skipped if ".experts." in g.prev}
        assert expert_groups[mode] | skipped == set(range(8))
    assert expert_groups["all"] == set(range(8))  # every expert's activation read on every token
    assert expert_groups["routed"] == routed and not routed & set(unused)  # the routed tokens' statistics only


@pytest.fixture(scope="module")
def outlier_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("smoothquant_moe")
    for family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        _with_outliers(tiny_moe(family)).save_pretrained(root / family)
        build_word_tokenizer().save_pretrained(root / family)
    return root


# measured (MSE / var of the float logits, 4 x 32 windows), GPTQ -> SmoothQuant + GPTQ:
# qwen3_moe 0.039 -> 0.0049, qwen2_moe 0.026 -> 0.012, mixtral under routed calibration 0.054 -> 0.033
@pytest.mark.parametrize(
    ("family", "extra"),
    [
        pytest.param("qwen3_moe", [], id="qwen3_moe"),
        pytest.param("qwen2_moe", [], id="qwen2_moe", marks=pytest.mark.slow),
        pytest.param("mixtral", ["--moe-calibration", "routed"], id="mixtral-routed", marks=pytest.mark.slow),
    ],
)
def test_w8a8_smoothquant_gptq_on_experts_is_closer_to_the_float_model(
    family: str,
    extra: list[str],
    outlier_moe: Path,
    tiny_calib_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = outlier_moe / family
    ids = load_file(str(tiny_calib_file))["input_ids"].long()
    with torch.inference_mode():
        expected = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(input_ids=ids).logits
    errors = {}
    for method in ("gptq", "smoothquant+gptq"):
        out = tmp_path / method
        args = ["quantize", str(model), "-o", str(out), "--calib", str(tiny_calib_file), "--scheme", "W8A8"]
        code, _, err = run_cli([*args, "--method", method, *extra], capsys)
        assert code == 0, err
        with torch.inference_mode():
            errors[method] = relative_error(load_model(out)(input_ids=ids).logits, expected)
    assert errors["smoothquant+gptq"] < 0.7 * errors["gptq"] and errors["smoothquant+gptq"] < 0.05, errors
    log = json.loads((tmp_path / "smoothquant+gptq" / "quantkit_log.json").read_text())
    records = [r for r in log["layers"] if r.get("kind") == "smoothquant"]
    assert [r["name"] for r in records] == ["model.layers.0", "model.layers.1"]
    assert all(r["alpha"] is not None and r["smooth_error"] < r["plain_error"] for r in records)
