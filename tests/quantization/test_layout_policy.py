"""Layouts engines refuse are checked before any work: strict (an error naming layers and fix), fallback (a smaller
group on those layers, recorded and shown by inspect), quantkit-only (the short last group, written on request)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import run_cli

from quantkit.errors import QuantkitError
from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.assignment import LayoutFallback, SchemeAssignment, fit_layouts

G128 = QuantScheme(bits=4, group_size=128)
IN_FEATURES = {"model.layers.0.self_attn.q_proj": 576, "model.layers.0.mlp.down_proj": 1536}


def test_strict_names_the_layers_and_the_fixes():
    with pytest.raises(QuantkitError) as info:
        fit_layouts(SchemeAssignment(dict.fromkeys(IN_FEATURES, G128)), IN_FEATURES, "strict")
    message = str(info.value)
    assert "1 layers would get a layout" in message and "self_attn.q_proj" in message and "down_proj" not in message
    assert "group size 128 does not divide its 576 in-features" in message
    assert "--group-size 64" in message and "--layout-policy fallback" in message


def test_fallback_changes_only_the_layers_that_need_it():
    with pytest.warns(LayoutFallback, match=r"g128 -> g64 on 1 linears \(self_attn.q_proj\)"):
        fitted = fit_layouts(SchemeAssignment(dict.fromkeys(IN_FEATURES, G128)), IN_FEATURES, "fallback")
    assert fitted.schemes["model.layers.0.self_attn.q_proj"].group_size == 64
    assert fitted.schemes["model.layers.0.mlp.down_proj"] == G128
    assert fitted.fallbacks == {"model.layers.0.self_attn.q_proj": "g128 -> g64"}


def test_dynamic_act_order_is_refused_even_with_fallback():
    dynamic = QuantScheme(bits=4, group_size=64, act_order=True, static_groups=False)
    with pytest.raises(QuantkitError, match="use --static-groups"):
        fit_layouts(SchemeAssignment(dict.fromkeys(IN_FEATURES, dynamic)), IN_FEATURES, "fallback")
    kept = fit_layouts(SchemeAssignment(dict.fromkeys(IN_FEATURES, dynamic)), IN_FEATURES, "quantkit-only")
    assert set(kept.schemes.values()) == {dynamic}


def _quantize(model: Path, out: Path, capsys, *args: str) -> tuple[int, str]:
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "--method", "rtn", *args], capsys)
    return code, err


def test_cli_strict_refuses_the_default_group_size_before_any_work(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _quantize(tiny_model_dir, out, capsys, "--layout-policy", "strict")  # g128 on in-features 64, 160
    assert code == 2 and "error: 14 layers would get a layout" in err and "--group-size 32" in err
    assert "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())  # no output, no work directory


def test_cli_defaults_write_a_checkpoint_every_engine_loads(tiny_model_dir, tmp_path, capsys):
    """No flags: the default g128 divides none of the tiny model's in-features (64, 160), so every layer falls
    back (g64 where it divides, g32 for down_proj), said in one warning line, and every engine loads the result."""
    out = tmp_path / "out"
    code, err = _quantize(tiny_model_dir, out, capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "layout:" in line]
    assert len(lines) == 1 and "g128 -> g64 on 12 linears" in lines[0] and "g128 -> g32 on 2 linears" in lines[0]
    assert "--layout-policy strict" in lines[0]
    assert all(v.loads for v in inspect_checkpoint(out).loads_in)


@pytest.mark.slow
def test_cli_fallback_is_recorded_and_inspected(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the layer table's cells unwrapped
    out = tmp_path / "out"
    code, err = _quantize(tiny_model_dir, out, capsys, "--group-size", "64", "--layout-policy", "fallback")
    assert code == 0, err
    log = json.loads((out / "quantkit_log.json").read_text())
    assert log["layout_fallbacks"] == {f"model.layers.{i}.mlp.down_proj": "g64 -> g32" for i in range(2)}
    report = inspect_checkpoint(out)
    by_name = {layer.name: layer for layer in report.layers}
    assert by_name["model.layers.0.mlp.down_proj"].scheme == "w4-g32-sym"
    assert by_name["model.layers.0.mlp.down_proj"].fallback == "g64 -> g32"
    assert (
        by_name["model.layers.0.mlp.up_proj"].scheme == "w4-g64-sym"
        and not by_name["model.layers.0.mlp.up_proj"].fallback
    )
    assert all(v.loads for v in report.loads_in)
    code, stdout, _ = run_cli(["inspect", str(out)], capsys)
    assert code == 0 and "fallback g64 -> g32" in stdout and "Loads in" in stdout


@pytest.mark.slow
def test_cli_quantkit_only_writes_the_short_last_group(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _quantize(tiny_model_dir, out, capsys, "--layout-policy", "quantkit-only")
    assert code == 0, err
    verdicts = {v.engine: v for v in inspect_checkpoint(out).loads_in}
    assert not verdicts["transformers"].loads and "does not divide" in verdicts["transformers"].summary


def test_recipe_refuses_the_layout_before_calibrating(tiny_model_dir, text_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {tiny_model_dir}\ncalibration: {{dataset: {text_corpus}}}\n"
        f"quantization: {{solvers: [rtn], scheme: {{bits: 4, group_size: 128}}, layout_policy: strict}}\n"
        f"output: {{directory: {tmp_path / 'ckpt'}}}\n"
    )
    code, _, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    assert code == 2 and "would get a layout" in err
    assert not (tmp_path / "cache" / "recipes").exists() and not (tmp_path / "ckpt").exists()
