"""Float targets in mixture-of-experts blocks: each expert linear's float moments are summed over exactly the rows
its Hessian sums (every token under ``--moe-calibration all``; under ``routed`` the tokens the quantized block
routes to the expert, with the float inputs of those same tokens), the float path's output is the float MoE's own
forward (float routing on float inputs), and a real run's logit error falls below plain GPTQ's."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.family_checks import relative_error
from helpers.gpt_oss import save_tiny_gpt_oss
from helpers.moe import save_tiny_moe, tiny_moe
from helpers.qwen3_5_moe import save_tiny_qwen3_5_moe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.model.architectures import arch_for_config
from quantkit.model.blocks import BlockRunner
from quantkit.model.moe import unfuse_experts
from quantkit.model.resolve import load_model
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.block_loop import stage_hessians
from quantkit.quantization.methods.float_targets import FloatCompanion, FloatPath

EXPERT = 3  # the expert whose moments are checked


def _mlp_input(block: torch.nn.Module, mlp_path: str, runner: BlockRunner, hidden: torch.Tensor):
    """The sparse MLP's input (the normalised residual stream) as [tokens, H], and the block's output."""
    seen = []
    handle = block.get_submodule(mlp_path).register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        out = runner(block, hidden)
    handle.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]), out


@pytest.mark.parametrize(("family", "mode"), [("qwen2_moe", "all"), ("qwen2_moe", "routed"), ("qwen3_moe", "routed")])
def test_expert_moments_are_summed_on_the_hessians_rows(family: str, mode: str) -> None:
    model = tiny_moe(family, seed=2)
    arch = arch_for_config(model.config.to_dict())
    unfuse_experts(model, arch)
    runner = BlockRunner.for_model(model, arch, 16, batch_size=2)
    block = model.model.layers[0]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        reference = model.model.embed_tokens(torch.randint(0, 256, (5, 16), generator=gen))
    quantized_input = reference + 0.3 * reference.std() * torch.randn(reference.shape, generator=gen)
    x_float, float_output = _mlp_input(block, arch.mlp_path, runner, reference)
    x_quantized, _ = _mlp_input(block, arch.mlp_path, runner, quantized_input)
    moe = block.get_submodule(arch.mlp_path)
    routed = (moe.route(x_quantized)[1] == EXPERT).any(dim=-1)
    if mode == "routed":  # the float router would pick other rows: the check can tell the two sets apart
        assert not torch.equal(routed, (moe.route(x_float)[1] == EXPERT).any(dim=-1))
    rows = routed if mode == "routed" else torch.ones_like(routed)
    expert = moe.expert_modules()[EXPERT]
    with torch.no_grad():
        a_float, a_quantized = expert.activation(x_float[rows]), expert.activation(x_quantized[rows])
    gate_up = f"gate_up.{EXPERT}" if mode == "routed" else "gate_up"
    expected = {  # stage -> (float inputs, quantized inputs) on the Hessian's rows
        gate_up: (x_float[rows], x_quantized[rows]),
        f"down.{EXPERT}": (a_float, a_quantized),
    }

    path = FloatPath(block, arch, runner, reference, mode)
    staged = StagedBlock(copy.deepcopy(block), arch, runner, quantized_input.clone(), moe_calibration=mode)
    checked = []
    for stage, hessian, (moments,) in stage_hessians(staged, companions=[FloatCompanion(path)]):
        if stage.name not in expected:
            continue
        x, x_q = expected[stage.name]
        n = x.shape[0]
        assert moments.count == n == int(rows.sum()) and moments.residual is None  # experts take no stream error
        assert torch.allclose(hessian, 2.0 / n * x_q.T @ x_q, rtol=1e-4, atol=1e-6)
        assert moments.gap is not None
        assert torch.allclose(moments.gap, 2.0 / n * (x - x_q).T @ x_q, rtol=1e-4, atol=1e-6)
        checked.append(stage.name)
    assert sorted(checked) == sorted(expected)
    # the float MoE's own forward: routed by the float router on the float inputs
    assert torch.allclose(path.output().float(), float_output.float(), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A tiny model of a family ("skewed": a qwen3_moe whose router never picks experts 6 and 7), saved once."""
    root = tmp_path_factory.mktemp("moe_float_targets")

    def model(name: str) -> Path:
        path = root / name
        if not path.exists():
            if name == "gpt_oss":
                save_tiny_gpt_oss(path)
            elif name == "qwen3_5_moe":
                save_tiny_qwen3_5_moe(path, initializer_range=0.02)  # the config's own range (see its tests)
            elif name == "skewed":
                save_tiny_moe(path, "qwen3_moe", unused_experts=(6, 7))
            else:
                save_tiny_moe(path, name)
        return path

    return model


def _quantize(model: Path, out: Path, calib: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    args = ["quantize", str(model), "-o", str(out), "--calib", str(calib), "--group-size", "32", "--method", "gptq"]
    code, _, err = run_cli([*args, *extra], capsys)
    assert code == 0, err
    return json.loads((out / "quantkit_log.json").read_text())


def _error(model: Path, checkpoint: Path, calib: Path) -> float:
    ids = load_file(str(calib))["input_ids"].long()
    with torch.inference_mode():
        expected = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(input_ids=ids).logits
        return relative_error(load_model(checkpoint)(input_ids=ids).logits, expected)


# measured (W4 g32, 4 x 32 windows, MSE / var of the float logits), plain GPTQ -> float targets:
# qwen3_moe 0.0051 -> 0.0039; qwen2_moe 0.0085 -> 0.0017, rotated 0.0099 -> 0.0017; mixtral 0.0168 -> 0.0072;
# gpt_oss 0.0071 -> 0.0008
CASES = [
    pytest.param("qwen2_moe", [], id="qwen2_moe"),
    pytest.param("qwen2_moe", ["--rotate", "hadamard"], id="qwen2_moe-rotated", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", [], id="qwen3_moe", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", ["--rotate", "hadamard"], id="qwen3_moe-rotated", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", ["--moe-calibration", "routed"], id="qwen3_moe-routed", marks=pytest.mark.slow),
    pytest.param("mixtral", [], id="mixtral", marks=pytest.mark.slow),
    pytest.param("gpt_oss", [], id="gpt_oss", marks=pytest.mark.slow),
    pytest.param("qwen3_5_moe", [], id="qwen3_5_moe", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "extra"), CASES)
def test_float_targets_lower_the_moe_logit_error(
    family: str,
    extra: list[str],
    moe_models: Callable[[str], Path],
    tiny_calib_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = moe_models(family)
    errors = {}
    for float_targets in (False, True):
        out = tmp_path / f"float-targets-{float_targets}"
        log = _quantize(model, out, tiny_calib_file, capsys, *extra, *(["--float-targets"] if float_targets else []))
        assert ("float_targets" in log["solvers"]) is float_targets
        if "routed" not in extra:  # every expert solved on every token (routed: the tiny set misses some)
            assert not any(r.get("fell_back_to_rtn") for r in log["layers"])
        errors[float_targets] = _error(model, out, tiny_calib_file)
    assert errors[True] < errors[False] < 0.03, errors


def test_an_expert_no_token_reaches_keeps_its_round_to_nearest_solve(
    moe_models: Callable[[str], Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Routed calibration: an expert without rows has no moments either; its linears are solved by round-to-nearest
    (recorded as a fallback) instead of a target divided by zero rows."""
    log = _quantize(
        moe_models("skewed"), tmp_path / "q", tiny_calib_file, capsys, "--float-targets", "--moe-calibration", "routed"
    )
    fell_back = {r["name"] for r in log["layers"] if r.get("fell_back_to_rtn")}
    never_routed = {r["name"] for r in log["layers"] if r.get("routed_tokens") == 0}
    assert fell_back == never_routed and len(fell_back) >= 2 * 3 * 2
    assert _error(moe_models("skewed"), tmp_path / "q", tiny_calib_file) < 0.05


@pytest.mark.parametrize("mode", ["all", "routed"])
def test_bfloat16_forward_passes_run_the_expert_stages_close_to_float32(mode: str) -> None:
    """--compute-dtype bfloat16 in a sparse block: every expert stage's Hessian and moments come out of bfloat16
    products (the routed sums added to float32 buffers), finite; with every token through every expert (``all``:
    the same rows either way) within 3% of the float32 run's. Routed, a near tie of the router may flip a token."""
    model = tiny_moe("qwen2_moe", seed=2)
    arch = arch_for_config(model.config.to_dict())
    unfuse_experts(model, arch)
    block = model.model.layers[0]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        reference = model.model.embed_tokens(torch.randint(0, 256, (5, 16), generator=gen))
    quantized_input = reference + 0.3 * reference.std() * torch.randn(reference.shape, generator=gen)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = BlockRunner.for_model(model, arch, 16, batch_size=2, compute_dtype=dtype)
        path = FloatPath(block, arch, runner, reference, mode)
        staged = StagedBlock(copy.deepcopy(block), arch, runner, quantized_input.clone(), moe_calibration=mode)
        companions = [FloatCompanion(path)]
        runs[dtype] = {stage.name: (h, m) for stage, h, (m,) in stage_hessians(staged, companions=companions)}
        assert not torch.is_autocast_enabled("cpu")
    exact, low = runs[torch.float32], runs[torch.bfloat16]
    assert exact.keys() == low.keys() and len(exact) > 2
    for name, (hessian, moments) in exact.items():
        low_hessian, low_moments = low[name]
        assert bool(torch.isfinite(low_hessian).all()), name
        if mode == "all":
            assert float((low_hessian - hessian).norm() / hessian.norm()) < 3e-2, name
            if moments.gap is not None and float(moments.gap.norm()) > 0:
                assert float((low_moments.gap - moments.gap).norm() / moments.gap.norm()) < 3e-2, name
