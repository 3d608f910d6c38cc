"""Mixture-of-experts models (qwen3_moe, mixtral, qwen2_moe) quantized per expert: checkpoints name every expert's
linears as llm-compressor and vLLM do, keep the router in float (listed as ignored), load back through quantkit
with logits close to the float model's, calibrate every expert on every token by default, and say in the coverage
audit which expert no token reached under routed calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.checkpoint import data_bytes
from helpers.cli import run_cli
from helpers.moe import MOE_FAMILIES, NUM_EXPERTS, save_tiny_moe
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.format.coverage import ROUTED, ROUTER, SHARED, audit_checkpoint
from quantkit.model.resolve import arch_for_dir, load_model

UNUSED = (6, 7)  # experts the skewed router never picks


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    dirs = {family: save_tiny_moe(root / family, family) for family in MOE_FAMILIES}
    dirs["skewed"] = save_tiny_moe(root / "skewed", "qwen3_moe", unused_experts=UNUSED)
    return dirs


def _quantize(model: Path, out: Path, calib: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> None:
    args = ["quantize", str(model), "-o", str(out), "--calib", str(calib), "--group-size", "32", *extra]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err


def _relative_logit_error(model: Path, checkpoint: Path, calib: Path) -> float:
    """Mean squared logit error of the checkpoint against the float model, over the float logits' variance."""
    ids = load_file(str(calib))["input_ids"].long()
    float_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)  # transformers' fused experts
    with torch.inference_mode():
        expected = float_model(input_ids=ids).logits
        got = load_model(checkpoint)(input_ids=ids).logits
    return float((got - expected).square().mean() / expected.var())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_expert_is_written_per_expert_and_the_router_stays_float(
    family: str, moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = moe_dirs[family]
    out = tmp_path / "q"
    _quantize(model, out, tiny_calib_file, capsys, "--method", "gptq")
    arch = arch_for_dir(model)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        for linear in arch.routed_expert_linears():
            assert f"{prefix}.{linear}.weight_packed" in names
            assert f"{prefix}.{linear}.weight_scale" in names
        for router in arch.float_linears:
            assert f"{prefix}.{router}.weight" in names and f"{prefix}.{router}.weight_scale" not in names
    assert len(arch.routed_expert_linears()) == 3 * NUM_EXPERTS
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    ignored = set(config["ignore"])
    assert {f"model.layers.{i}.{router}" for i in range(2) for router in arch.float_linears} <= ignored
    # GPTQ on W4 g32 keeps the logits as close as on a dense model of the same size (0.004 to 0.007 there)
    assert _relative_logit_error(model, out, tiny_calib_file) < 0.03


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_rtn_and_awq_quantize_a_mixture_of_experts(
    method: str, moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = moe_dirs["qwen2_moe"]  # routed experts, a shared expert and its gate: every AWQ group kind
    _quantize(model, tmp_path / "q", tiny_calib_file, capsys, "--method", method)
    _quantize(model, tmp_path / "g", tiny_calib_file, capsys, "--method", "gptq")
    error = _relative_logit_error(model, tmp_path / "q", tiny_calib_file)
    assert error < 0.2  # measured: RTN 0.125, AWQ 0.04 at hidden 128 (a dense Llama at hidden 64: RTN 0.052)
    assert _relative_logit_error(model, tmp_path / "g", tiny_calib_file) < error  # GPTQ below both


def test_all_expert_calibration_solves_every_expert_even_those_no_token_reaches(
    moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = moe_dirs["skewed"]
    runs = {}
    for mode in ("all", "routed"):
        out = tmp_path / mode
        _quantize(model, out, tiny_calib_file, capsys, "--method", "gptq", "--moe-calibration", mode)
        runs[mode] = (json.loads((out / "quantkit_log.json").read_text()), audit_checkpoint(out), out)

    log, audit, out = runs["all"]
    assert log["moe_calibration"] == "all" and runs["routed"][0]["moe_calibration"] == "routed"
    experts = [r for r in log["layers"] if ".experts." in r["name"]]
    assert len(experts) == 2 * 3 * NUM_EXPERTS
    unused = [r for r in experts if int(r["name"].split(".experts.")[1].split(".")[0]) in UNUSED]
    assert unused and all(r["routed_tokens"] == 0 for r in unused)  # the router really never picks them
    assert not any(r["fell_back_to_rtn"] for r in experts)  # yet every expert is solved by GPTQ
    kinds = {k.kind: k for k in audit.kinds}
    assert kinds[ROUTED].quantized_params == kinds[ROUTED].params and kinds[ROUTED].rtn_fallbacks == 0
    assert kinds[ROUTER].quantized_params == 0 and kinds[ROUTER].modules == 2
    assert audit.total_bytes == data_bytes(out)
    tokens = sum(r["routed_tokens"] for r in experts if r["name"].startswith("model.layers.0.") and "gate" in r["name"])
    calib_tokens = load_file(str(tiny_calib_file))["input_ids"].numel()
    assert tokens == 2 * calib_tokens  # top-2: every token counted at two experts

    log, audit, _ = runs["routed"]
    fell_back = {r["name"] for r in log["layers"] if r["fell_back_to_rtn"]}
    never_routed = {r["name"] for r in log["layers"] if r.get("routed_tokens") == 0}
    assert fell_back == never_routed and len(fell_back) >= 2 * 3 * len(UNUSED)
    assert {k.kind: k for k in audit.kinds}[ROUTED].rtn_fallbacks == len(fell_back)


def test_a_shared_expert_is_its_own_kind_in_the_audit(
    moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q"
    _quantize(moe_dirs["qwen2_moe"], out, tiny_calib_file, capsys, "--method", "rtn")
    kinds = {k.kind: k for k in audit_checkpoint(out).kinds}
    assert kinds[SHARED].modules == 2 * 3 and kinds[SHARED].quantized_params == kinds[SHARED].params
    assert kinds[ROUTER].modules == 2 * 2  # the router and the shared expert's gate, per layer


def test_one_expert_cannot_take_another_scheme(
    moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["quantize", str(moe_dirs["mixtral"]), "-o", str(tmp_path / "q"), "--calib", str(tiny_calib_file)]
    code, _, err = run_cli([*args, "--method", "rtn", "--ignore", r"experts\.3\.w2$"], capsys)
    assert code != 0 and "must share one scheme" in err
    assert not (tmp_path / "q").exists()


def test_mixed_dense_and_sparse_layers_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = save_tiny_moe(tmp_path / "m", "qwen3_moe")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [0]}))
    code, _, err = run_cli(["quantize", str(model), "-o", str(tmp_path / "q"), "--method", "rtn"], capsys)
    assert code != 0 and "mix dense and sparse MLP layers" in err


def test_rotation_folds_into_experts_and_router(
    moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = moe_dirs["qwen2_moe"]
    _quantize(model, tmp_path / "q", tiny_calib_file, capsys, "--method", "gptq", "--rotate", "hadamard")
    # a wrong fold (the router or an expert's down_proj left unrotated) would scramble routing and the logits
    assert _relative_logit_error(model, tmp_path / "q", tiny_calib_file) < 0.03


def test_a_layers_experts_are_one_planner_unit(
    moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = moe_dirs["mixtral"]
    sens, plan = tmp_path / "m.json", tmp_path / "plan.yaml"
    args = ["sensitivity", str(model), "-o", str(sens), "--calib", str(tiny_calib_file), "--mode", "proxy"]
    assert run_cli([*args, "--candidates", "int4-g32,int8"], capsys)[0] == 0
    units = json.loads(sens.read_text())["units"]
    experts = [u for u in units if u["name"].endswith(".experts")]
    arch = arch_for_dir(model)
    assert len(units) == 2 * 3 and len(experts) == 2
    assert set(experts[0]["modules"]) == {f"model.layers.0.{n}" for n in arch.routed_expert_linears()}
    assert run_cli(["plan", str(sens), "--target-bits", "6", "-o", str(plan)], capsys)[0] == 0
    _quantize(model, tmp_path / "q", tiny_calib_file, capsys, "--plan", str(plan))
    schemes = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(schemes) == 2  # int4 and int8 both chosen somewhere, each expert group under one of them


def test_experts_vllm_cannot_load_are_refused_before_any_work(
    moe_dirs: dict[str, Path], tiny_calib_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["quantize", str(moe_dirs["qwen3_moe"]), "-o", str(tmp_path / "q"), "--method", "rtn"]
    code, _, err = run_cli([*args, "--bits", "3", "--group-size", "32"], capsys)  # Marlin MoE: int4 and int8 only
    assert code != 0 and "fused-MoE" in err and "quantkit-only" in err
    assert not (tmp_path / "q").exists()
    code, _, err = run_cli([*args, "--bits", "3", "--group-size", "32", "--layout-policy", "quantkit-only"], capsys)
    assert code == 0, err  # quantkit's own loader and runtime read it


def test_experts_solved_a_few_at_a_time_give_the_same_codes(
    moe_dirs: dict[str, Path],
    tiny_calib_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate/up stage stacks every expert on one Hessian; cut into chunks (memory bound) it gives the same bytes."""
    from quantkit.quantization import quantize_block

    model = moe_dirs["qwen3_moe"]
    _quantize(model, tmp_path / "whole", tiny_calib_file, capsys, "--method", "gptq")
    monkeypatch.setattr(quantize_block, "MAX_STACKED_EXPERT_ROWS", 3 * 64)  # 1.5 experts: cuts inside one too
    _quantize(model, tmp_path / "chunks", tiny_calib_file, capsys, "--method", "gptq")
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    chunks = load_file(str(tmp_path / "chunks" / "model.safetensors"))
    assert whole.keys() == chunks.keys()
    assert all(torch.equal(whole[name], chunks[name]) for name in whole)
