"""The Python face: ``quantkit.quantize`` / ``quantkit.evaluate`` do what the CLI does, and import lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.cli import run_cli

import quantkit


def test_import_quantkit_loads_no_torch() -> None:
    code = "import sys, quantkit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_public_name_resolves() -> None:
    for name in quantkit.__all__:
        assert getattr(quantkit, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = quantkit.nothing


def test_quantize_function_writes_the_cli_checkpoint(tiny_model_dir, text_corpus, tmp_path, capsys) -> None:
    scheme = quantkit.QuantScheme(bits=4, group_size=32)
    result = quantkit.quantize(
        tiny_model_dir, quantkit.QuantizeConfig.for_method("rtn", scheme=scheme), tmp_path / "api"
    )
    assert result.method == "rtn" and result.blocks == 2 and len(result.records) == 14
    args = ["quantize", str(tiny_model_dir), "-o", str(tmp_path / "cli"), "--method", "rtn", "--group-size", "32"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name

    scores = quantkit.evaluate(
        tmp_path / "api",
        quantkit.EvalConfig(dataset=str(text_corpus), seq_len=16, max_windows=2, show_progress=False),
    )
    assert scores.windows == 2 and scores.perplexity > 1.0 and scores.kl_mean is None


def test_solver_lists_and_method_spellings_are_one_thing() -> None:
    composed = quantkit.QuantizeConfig.of([quantkit.AWQConfig(), quantkit.GPTQConfig(damp=0.02)])
    spelled = quantkit.QuantizeConfig.of("awq+gptq")
    assert composed.method == spelled.method == "awq+gptq"
    assert composed.steps.solver.config.damp == 0.02 and spelled.steps.solver.config == quantkit.GPTQConfig()
    assert quantkit.QuantizeConfig.of(quantkit.GPTQConfig()).method == "gptq"
    assert quantkit.QuantizeConfig.of(None).method == "gptq"
    # the method's default scheme: AWQ asymmetric, GPTQ act-order with static groups and MSE clipping
    assert not spelled.resolved_scheme().symmetric and spelled.resolved_scheme().act_order
    gptq = quantkit.QuantizeConfig.of("gptq").resolved_scheme()
    assert (gptq.symmetric, gptq.act_order, gptq.static_groups, gptq.mse_clip) == (True, True, True, True)
    with pytest.raises(quantkit.errors.QuantkitError, match=r"exactly one weight solver \(rtn, gptq\); it has none"):
        quantkit.QuantizeConfig.of(quantkit.AWQConfig())
    # each algorithm runs at its role's place, whatever the order written
    assert quantkit.QuantizeConfig.of([quantkit.GPTQConfig(), quantkit.AWQConfig()]).method == "awq+gptq"
    tuned = quantkit.QuantizeConfig.for_method("gptq", quantkit.TuneConfig(steps=3), quantkit.RotationConfig())
    assert [type(s.config).__name__ for s in tuned.steps] == ["RotationConfig", "GPTQConfig", "TuneConfig"]
    assert quantkit.QuantizeConfig.for_method("gptq", quantkit.TuneConfig(steps=0)).steps.method == "gptq"
    with pytest.raises(quantkit.errors.QuantkitError, match="method 'gptq' has no awq step"):
        quantkit.QuantizeConfig.for_method("gptq", quantkit.AWQConfig())
