"""Recipe schema: round trip, located validation errors, ${ENV} substitution, --set overrides, `recipe new`."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli

from quantkit.recipes.schema import RecipeError, dump_recipe, load_recipe, recipe_from_text
from quantkit.recipes.starter import STARTER

REPO = Path(__file__).resolve().parents[2]

BASE = """\
model: smollm2-135m
calibration:
  num_samples: 16
quantization:
  method: gptq
  scheme:
    bits: 4
    group_size: 64
  ignore: ['layers\\.0\\.mlp']
output:
  directory: out/x
gates:
  max_kl_mean: 0.1
"""


def _error(text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_text(text, "r.yaml", overrides)
    return str(info.value)


def test_round_trip_load_dump_load_is_equal():
    recipe = recipe_from_text(BASE, "r.yaml")
    assert recipe.quantization.scheme.group_size == 64
    assert recipe.quantization.ignore == [r"layers\.0\.mlp"]
    assert recipe_from_text(dump_recipe(recipe)) == recipe
    mixed = recipe_from_text(
        "model: m\noutput: {directory: o}\nevaluation: {windows: null}\n"
        "quantization:\n  mixed: {target_bits: 4.5, pins: {'down_proj$': int8}}\n"
    )
    assert mixed.evaluation.windows is None
    assert recipe_from_text(dump_recipe(mixed)) == mixed


def test_shipped_recipes_validate():
    names = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
    assert {"ci.yaml", "w4-rtn.yaml", "w4-gptq.yaml", "w4-awq.yaml", "w4-awq-gptq.yaml", "w8.yaml"} <= set(names)
    assert "mixed-4.5.yaml" in names
    for path in (REPO / "recipes").glob("*.yaml"):
        load_recipe(path)


def test_typo_names_file_line_key_and_suggestion():
    message = _error(BASE.replace("group_size: 64", "group_sise: 64"))
    assert message.startswith("r.yaml:8: quantization.scheme.group_sise")
    assert "did you mean 'group_size'" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = _error(BASE + "flavour: spicy\n")
    assert message.startswith("r.yaml:14: flavour: unknown key")
    assert "valid keys here: model, output" in message


def test_wrong_type_says_what_was_expected():
    message = _error(BASE.replace("num_samples: 16", "num_samples: many"))
    assert message.startswith("r.yaml:3: calibration.num_samples")
    assert "expected an integer, got str 'many'" in message
    assert "expected true or false" in _error(BASE + "smoke: {enabled: 3}\n")


def test_bad_choice_suggests_the_closest():
    message = _error(BASE.replace("method: gptq", "method: gtpq"))
    assert message.startswith("r.yaml:5: quantization.method")
    assert "did you mean 'gptq'" in message


def test_missing_required_key():
    message = _error(BASE.replace("output:\n  directory: out/x\n", "output: {force: true}\n"))
    assert "output.directory: missing required key 'directory'" in message
    assert "missing required key 'model'" in _error(BASE.replace("model: smollm2-135m\n", ""))


def test_bad_regex_names_the_item_line():
    message = _error(BASE.replace("'layers\\.0\\.mlp'", "'a(b'"))
    assert message.startswith("r.yaml:9: quantization.ignore[0]")
    assert "not a valid regular expression" in message


def test_mixed_and_scheme_conflict_and_budget():
    assert "exactly one budget" in _error("model: m\noutput: {directory: o}\nquantization: {mixed: {}}\n")
    message = _error(BASE.replace("  ignore:", "  mixed: {target_bits: 4.5}\n  ignore:"))
    assert "quantization.scheme" in message and "does not apply" in message


def test_env_substitution_with_default_and_typing(monkeypatch):
    text = BASE.replace("bits: 4", "bits: ${QK_BITS:-4}").replace("out/x", "${QK_OUT}/x")
    monkeypatch.setenv("QK_OUT", "/tmp/qk")
    recipe = recipe_from_text(text, "r.yaml")
    assert recipe.quantization.scheme.bits == 4 and recipe.output.directory == "/tmp/qk/x"
    monkeypatch.setenv("QK_BITS", "8")
    assert recipe_from_text(text, "r.yaml").quantization.scheme.bits == 8


def test_env_without_default_is_an_error(monkeypatch):
    monkeypatch.delenv("QK_MISSING", raising=False)
    message = _error(BASE.replace("out/x", "${QK_MISSING}/x"))
    assert message.startswith("r.yaml:11:") and "QK_MISSING" in message and "${QK_MISSING:-default}" in message


def test_set_overrides_are_typed_and_validated():
    recipe = recipe_from_text(
        BASE, "r.yaml", ["quantization.scheme.bits=8", "gates.min_top1_agreement=0.9", "smoke.prompts=[hi, there]"]
    )
    assert recipe.quantization.scheme.bits == 8
    assert recipe.gates.min_top1_agreement == 0.9 and recipe.gates.max_kl_mean == 0.1
    assert recipe.smoke.prompts == ["hi", "there"]
    message = _error(BASE, ["quantization.scheme.bitz=8"])
    assert "(--set quantization.scheme.bitz=8)" in message and "did you mean 'bits'" in message
    assert "expected one of 2, 3, 4, 8" in _error(BASE, ["quantization.scheme.bits=5"])
    assert "KEY.PATH=VALUE" in _error(BASE, ["nonsense"])


def test_invalid_yaml_reports_the_line():
    assert _error(BASE + "gates: [unclosed\n").startswith("r.yaml:")


def test_recipe_new_output_validates(tmp_path, capsys):
    path = tmp_path / "new.yaml"
    code, _, err = run_cli(["recipe", "new", "-o", str(path)], capsys)
    assert code == 0, err
    assert path.read_text() == STARTER and "#" in STARTER
    code, out, err = run_cli(["recipe", "validate", str(path)], capsys)
    assert code == 0, err
    assert "is valid" in out
    code, _, err = run_cli(["recipe", "new", "-o", str(path)], capsys)
    assert code == 2 and "exists" in err


def test_validate_cli_error_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE.replace("group_size", "group_sise"))
    code, _, err = run_cli(["recipe", "validate", str(path)], capsys)
    assert code == 2
    assert f"{path}:8: quantization.scheme.group_sise" in err and "group_size" in err
