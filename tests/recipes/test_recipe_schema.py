"""Recipe schema: round trip, located validation errors, ${ENV} substitution, --set overrides, `recipe new`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.cli import run_cli

from quantkit.format.presets import PRESETS
from quantkit.recipes.schema import RecipeError, dump_recipe, load_recipe, recipe_from_text
from quantkit.recipes.starter import STARTER

REPO = Path(__file__).resolve().parents[2]

BASE = """\
model: smollm2-135m
calibration:
  num_samples: 16
quantization:
  solvers: {gptq: {}}
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
    assert {
        "mixed-4.5.yaml",
        "best-at-w4-size.yaml",
        "best-at-w3-size.yaml",
        "best-at-w4-size-transformers.yaml",
    } <= set(names)
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
    message = _error(BASE.replace("solvers: {gptq: {}}", "solvers: {gtpq: {}}"))
    assert message.startswith("r.yaml:5: quantization.solvers.gtpq")
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
    assert "expected one of float32, bfloat16, auto" in _error(BASE, ["quantization.compute_dtype=float16"])
    bf16 = recipe_from_text(BASE, "r.yaml", ["quantization.compute_dtype=bfloat16"])
    assert bf16.quantization.compute_dtype == "bfloat16"
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


# --------------------------------------------------------------------------------------------------
# One case per validation rule: the file and line, the key path, and the hint
# --------------------------------------------------------------------------------------------------

FULL = """\
model: smollm2-135m
calibration:
  dataset: null
  num_samples: 16
  seq_len: 256
  seed: 0
  strategy: random
  select: random
  min_length: 8
  text_column: text
quantization:
  scheme:
    bits: 4
    group_size: 64
    symmetric: true
  solvers:
    gptq:
      damp: 0.01
  ignore: ['layers\\.0\\.mlp']
output:
  directory: out/x
  force: false
evaluation:
  windows: 8
  seq_len: 512
  batch_size: 4
gates:
  max_ppl_increase_pct: 10
  max_kl_mean: 0.1
  min_top1_agreement: 0.8
smoke:
  enabled: true
  prompts: [hello]
  max_tokens: 16
"""

MIXED = """\
model: m
output: {directory: o}
quantization:
  mixed:
    target_bits: 4.5
    candidates: [int4-g128, int8]
    pins: {'down_proj$': int8}
    mode: proxy
"""


def _case(base: str, old: str, new: str, key_path: str, hint: str, name: str, delta: int = 0) -> object:
    return pytest.param(base, old, new, key_path, hint, delta, id=name)


RULES = [
    # keys
    _case(FULL, "  seed: 0", "  sed: 0", "calibration.sed", "unknown key 'sed'; did you mean 'seed'?", "unknown-key"),
    _case(
        FULL, "  force: false", "  colour: red", "output.colour", "valid keys here: directory, force", "no-close-key"
    ),
    _case(
        FULL,
        "  directory: out/x\n",
        "",
        "output.directory",
        "missing required key 'directory' in output",
        "missing",
        -1,
    ),
    _case(FULL, "model: smollm2-135m\n", "", "model", "missing required key 'model' in the top level", "missing-top"),
    _case(FULL, "  seed: 0", "  seed: 0\n  seed: 1", "", "duplicate key 'seed'; keep one", "duplicate-key", 1),
    # types
    _case(
        FULL,
        "  num_samples: 16",
        "  num_samples: many",
        "calibration.num_samples",
        "expected an integer, got str 'many'",
        "int",
    ),
    _case(FULL, "  force: false", "  force: 3", "output.force", "expected true or false, got int 3", "bool"),
    _case(
        FULL,
        "  text_column: text",
        "  text_column: 5",
        "calibration.text_column",
        "expected a string, got int 5 (quote it)",
        "str",
    ),
    _case(
        FULL,
        "      damp: 0.01",
        "      damp: high",
        "quantization.solvers.gptq.damp",
        "expected a number, got str 'high'",
        "float",
    ),
    _case(
        FULL,
        "  prompts: [hello]",
        "  prompts: hello",
        "smoke.prompts",
        "expected a list of strings (or null), got str",
        "list",
    ),
    _case(
        FULL,
        "  prompts: [hello]",
        "  prompts: [1]",
        r"smoke.prompts\[0\]",
        "expected a string, got int 1 (quote it)",
        "item",
    ),
    _case(
        FULL,
        "output:\n  directory: out/x\n  force: false",
        "output: 3",
        "output",
        "expected a mapping with keys directory, force, formats, gguf, got int 3",
        "mapping",
    ),
    # choices
    _case(
        FULL,
        "    gptq:",
        "    gtpq:",
        "quantization.solvers.gtpq",
        "unknown key 'gtpq'; did you mean 'gptq'?",
        "solver-name",
    ),
    _case(FULL, "    bits: 4", "    bits: 5", "quantization.scheme.bits", "expected one of 2, 3, 4, 8, got 5", "bits"),
    _case(
        FULL,
        "  strategy: random",
        "  strategy: documents",
        "calibration.strategy",
        "did you mean 'document'?",
        "strategy",
    ),
    _case(FULL, "  select: random", "  select: divers", "calibration.select", "did you mean 'diverse'?", "select"),
    _case(MIXED, "    mode: proxy", "    mode: hybird", "quantization.mixed.mode", "did you mean 'hybrid'?", "mode"),
    # ranges
    _case(
        FULL,
        "  num_samples: 16",
        "  num_samples: 0",
        "calibration.num_samples",
        "expected a value >= 1, got 0",
        "num-samples",
    ),
    _case(
        FULL, "  seq_len: 256", "  seq_len: 1", "calibration.seq_len", "expected a value >= 2, got 1", "calib-seq-len"
    ),
    _case(
        FULL,
        "  min_length: 8",
        "  min_length: 0",
        "calibration.min_length",
        "expected a value >= 1, got 0",
        "min-length",
    ),
    _case(
        FULL,
        "      damp: 0.01",
        "      damp: 1",
        "quantization.solvers.gptq",
        "GPTQ damp must be in [0, 1), got 1",
        "damp",
        -1,
    ),
    _case(
        FULL,
        "      damp: 0.01",
        "      damp: 0.01\n    tune: {lr: 0}",
        "quantization.solvers.tune",
        "--tune-lr must be positive",
        "tune-lr",
        1,
    ),
    _case(
        FULL,
        "    gptq:\n      damp: 0.01",
        "    rtn: {}\n    float_targets: {}",
        "quantization.solvers",
        "float targets work only with gptq: method 'rtn' has no gptq step; use gptq, awq+gptq, smoothquant+gptq",
        "float-targets-without-gptq",
        -1,
    ),
    _case(
        FULL,
        "    gptq:\n      damp: 0.01",
        "    gptq: {}\n    rtn: {}",
        "quantization.solvers",
        "a job needs exactly one weight solver (rtn, gptq); it has rtn, gptq",
        "two-solvers",
        -1,
    ),
    _case(
        FULL,
        "    bits: 4",
        "    preset: W5A16",
        "quantization.scheme.preset",
        f"expected one of {', '.join(PRESETS)}, got 'W5A16'",
        "preset",
    ),
    _case(
        FULL,
        "    group_size: 64",
        "    group_size: 0",
        "quantization.scheme.group_size",
        "expected a positive size such as 64 or 128, or -1",
        "group-size",
    ),
    _case(FULL, "  windows: 8", "  windows: 0", "evaluation.windows", "expected a value >= 1, got 0", "windows"),
    _case(FULL, "  seq_len: 512", "  seq_len: 1", "evaluation.seq_len", "expected a value >= 2, got 1", "eval-seq-len"),
    _case(
        FULL,
        "  batch_size: 4",
        "  batch_size: 0",
        "evaluation.batch_size",
        "expected a value >= 1, got 0",
        "batch-size",
    ),
    _case(
        FULL, "  max_kl_mean: 0.1", "  max_kl_mean: -1", "gates.max_kl_mean", "expected a value >= 0, got -1", "max-kl"
    ),
    _case(
        FULL,
        "  min_top1_agreement: 0.8",
        "  min_top1_agreement: 2",
        "gates.min_top1_agreement",
        "expected a value <= 1, got 2",
        "top1",
    ),
    _case(
        FULL, "  max_tokens: 16", "  max_tokens: 0", "smoke.max_tokens", "expected a value >= 1, got 0", "max-tokens"
    ),
    _case(
        MIXED,
        "    target_bits: 4.5",
        "    target_bits: 0",
        "quantization.mixed.target_bits",
        "expected a value > 0, got 0",
        "target-bits",
    ),
    # regexes and candidates
    _case(
        FULL,
        "  ignore: ['layers\\.0\\.mlp']",
        "  ignore:\n  - ok\n  - 'a(b'",
        r"quantization.ignore\[1\]",
        "'a(b' is not a valid regular expression",
        "ignore-regex",
        2,
    ),
    _case(
        MIXED,
        "{'down_proj$': int8}",
        "{'a(b': int8}",
        r"quantization.mixed.pins\['a\(b'\] \(key\)",
        "not a valid regular expression",
        "pin-regex",
    ),
    _case(
        MIXED,
        "{'down_proj$': int8}",
        "{'down_proj$': int5}",
        r"quantization.mixed.pins\['down_proj\$'\]",
        "unknown candidate 'int5'",
        "pin-candidate",
    ),
    _case(
        MIXED,
        "[int4-g128, int8]",
        "[int4-g128, int4-g100]",
        r"quantization.mixed.candidates\[1\]",
        "unknown candidate 'int4-g100'; use int<bits>",
        "candidate",
    ),
    _case(
        MIXED,
        "[int4-g128, int8]",
        "[]",
        "quantization.mixed.candidates",
        "expected at least one item, got an empty list",
        "no-candidates",
    ),
    # rules across keys
    _case(
        MIXED,
        "    target_bits: 4.5\n",
        "    max_size_mb: 60\n    target_bits: 4.5\n",
        "quantization.mixed",
        "give exactly one budget",
        "one-budget",
        -1,
    ),
    _case(
        MIXED,
        "    mode: proxy",
        "    mode: proxy\n  plan: p.yaml",
        "quantization.plan",
        "give either 'mixed' or 'plan', not both",
        "mixed-and-plan",
        1,
    ),
    _case(
        MIXED,
        "    mode: proxy",
        "    mode: proxy\n  scheme: {bits: 8}",
        "quantization.scheme",
        "a scheme does not apply with 'mixed' or 'plan'",
        "scheme-with-mixed",
        1,
    ),
    _case(FULL, FULL, "- model: m\n", "", "expected a mapping with keys model, output, calibration", "not-a-mapping"),
]


@pytest.mark.parametrize(("base", "old", "new", "key_path", "hint", "delta"), RULES)
def test_each_rule_names_file_line_path_and_hint(
    tmp_path: Path, base: str, old: str, new: str, key_path: str, hint: str, delta: int
) -> None:
    assert base.count(old) == 1, old
    line = base[: base.index(old)].count("\n") + 1 + delta
    path = tmp_path / "r.yaml"
    path.write_text(base.replace(old, new))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert re.match(rf"{re.escape(str(path))}:{line}: " + (rf"{key_path}: " if key_path else ""), message), message
    assert hint in message, message


def test_set_override_errors_name_the_override():
    message = _error(BASE, ["evaluation.windows=0"])
    assert message.startswith("r.yaml (--set evaluation.windows=0): evaluation.windows: expected a value >= 1, got 0")
    message = _error(BASE, ["model.name=x"])
    assert message == "r.yaml (--set model.name=x): 'model' is not a mapping, cannot set a key in it"


def test_defaults_come_from_the_config_classes():
    from quantkit.data.calibration import CalibrationConfig
    from quantkit.eval.evaluate import EvalConfig
    from quantkit.mixed.candidates import DEFAULT_CANDIDATES
    from quantkit.quantization.config import QuantizeConfig
    from quantkit.quantization.methods.composition import JobSteps, parse_method, resolve_scheme
    from quantkit.quantization.methods.gptq import GPTQConfig

    recipe = recipe_from_text("model: m\noutput: {directory: o}\n")
    cal = recipe.calibration
    assert (cal.num_samples, cal.seq_len, cal.strategy) == (
        CalibrationConfig.num_samples,
        CalibrationConfig.seq_len,
        "random",
    )
    assert recipe.quantization.solver_configs() == [GPTQConfig()]
    assert recipe.evaluation.batch_size == EvalConfig.batch_size
    assert recipe.quantization.layout_policy == QuantizeConfig.layout_policy
    assert recipe.quantization.batch_size == QuantizeConfig.batch_size
    assert recipe.evaluation.windows == 40 and recipe.smoke.max_tokens == 16
    assert recipe.quantization.quant_scheme() == resolve_scheme(JobSteps(parse_method("gptq")).scheme_defaults())
    text = "model: m\noutput: {directory: o}\nquantization: {solvers: [awq], scheme: {act_order: true}}\n"
    with pytest.raises(RecipeError, match="exactly one weight solver"):  # the list names every algorithm
        recipe_from_text(text)
    awq = recipe_from_text(text.replace("[awq]", "[awq, rtn]"))
    awq_defaults = JobSteps(parse_method("awq")).scheme_defaults()
    assert awq.quantization.quant_scheme() == resolve_scheme(awq_defaults, act_order=True)
    mixed = recipe_from_text(MIXED.replace("    candidates: [int4-g128, int8]\n", ""))
    assert mixed.quantization.mixed is not None and mixed.quantization.mixed.candidates == list(DEFAULT_CANDIDATES)


def test_solvers_in_any_form_and_order_mean_the_same_job():
    from quantkit.quantization.methods.rotation import RotationConfig
    from quantkit.quantization.methods.tune import TuneConfig

    def configs(solvers: str) -> list:
        text = f"model: m\noutput: {{directory: o}}\nquantization: {{solvers: {solvers}}}\n"
        return recipe_from_text(text).quantization.solver_configs()

    mapping = configs("{tune: {steps: 5}, gptq: {}, rotation: {seed: 2}}")
    assert [type(c).__name__ for c in mapping] == ["RotationConfig", "GPTQConfig", "TuneConfig"]
    assert mapping[0] == RotationConfig(seed=2) and mapping[2] == TuneConfig(steps=5)
    assert configs("[{rotation: {seed: 2}}, gptq, {tune: {steps: 5}}]") == mapping
    assert configs("{rotation: {seed: 2}, gptq: true, tune: {steps: 5}, awq: false}") == mapping


def test_a_scheme_preset_by_name():
    recipe = recipe_from_text("model: m\noutput: {directory: o}\nquantization: {scheme: W4A16_ASYM}\n")
    scheme = recipe.quantization.quant_scheme()
    assert (scheme.bits, scheme.group_size, scheme.symmetric, scheme.act_order) == (4, 128, False, True)
    given = "quantization: {scheme: {preset: W8A16, group_size: -1}}"
    scheme = recipe_from_text(f"model: m\noutput: {{directory: o}}\n{given}\n").quantization.quant_scheme()
    assert (scheme.bits, scheme.group_size, scheme.symmetric) == (8, -1, True)


def test_the_old_flat_keys_become_solvers_with_one_warning(tmp_path):
    from quantkit.recipes.legacy import LegacyRecipe

    old = (
        "model: m\noutput: {directory: o}\nquantization:\n  method: awq+gptq\n  damp: 0.02\n"
        "  rotate: hadamard\n  rotate_seed: 3\n  tune_steps: 4\n  tune_lr: 0.05\n  refit_head: true\n"
    )
    with pytest.warns(LegacyRecipe, match=r"old flat form; write `solvers: \{awq: \{\}, gptq: \{damp: 0.02\}"):
        recipe = recipe_from_text(old, "r.yaml")
    new = recipe_from_text(
        "model: m\noutput: {directory: o}\nquantization:\n  solvers: {rotation: {seed: 3}, awq: {}, "
        "gptq: {damp: 0.02}, tune: {steps: 4, lr: 0.05}, head_refit: {}}\n"
    )
    assert recipe.quantization.solver_configs() == new.quantization.solver_configs()
    with pytest.warns(LegacyRecipe):
        off = recipe_from_text(old.replace("tune_steps: 4", "tune_steps: 0").replace("hadamard", "none"), "r.yaml")
    assert [type(c).__name__ for c in off.quantization.solver_configs()] == [
        "AWQConfig",
        "GPTQConfig",
        "HeadRefitConfig",
    ]
    with pytest.warns(LegacyRecipe):
        message = _error(old.replace("damp: 0.02", "damp: 2"))
    assert message.startswith("r.yaml:4: quantization.solvers.gptq") and "damp must be in [0, 1)" in message
    assert "both 'solvers' and the old flat keys" in _error(old.replace("  damp", "  solvers: {}\n  damp"))


def test_device_is_checked_for_its_form_only_and_the_run_checks_the_machine(monkeypatch):
    import torch

    from quantkit.errors import QuantkitError
    from quantkit.recipes.stages import preflight

    assert recipe_from_text(BASE, "r.yaml").device == "auto"
    recipe = recipe_from_text(BASE + "device: cuda:1\n", "r.yaml")  # validates on a machine without a GPU
    assert recipe.device == "cuda:1" and recipe_from_text(dump_recipe(recipe)) == recipe
    message = _error(BASE + "device: gpu\n")
    assert message.startswith("r.yaml:14: device") and "use one of auto, cpu, cuda (or cuda:N)" in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuantkitError, match="device 'cuda:1' is not available"):
        preflight(recipe)
    message = _error(BASE + "device: cpu\n", ["device=tpu"])
    assert message == "r.yaml (--set device=tpu): device: 'tpu' is invalid; use one of auto, cpu, cuda (or cuda:N)"


def _recipe_with_plan(plan: str) -> str:
    return f"model: smollm2-135m\nquantization:\n  plan: {plan}\noutput: {{directory: out}}\n"


def test_a_relative_plan_is_read_beside_the_recipe_before_the_current_directory(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes"
    (recipes / "plans").mkdir(parents=True)
    (recipes / "plans" / "p.yaml").write_text("beside the recipe\n")
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "p.yaml").write_text("in the current directory\n")
    (recipes / "r.yaml").write_text(_recipe_with_plan("plans/p.yaml"))
    monkeypatch.chdir(tmp_path)
    assert load_recipe("recipes/r.yaml").quantization.plan == str(Path("recipes/plans/p.yaml"))
    (recipes / "plans" / "p.yaml").unlink()  # as before this rule: a path from the current directory still works
    assert load_recipe("recipes/r.yaml").quantization.plan == "plans/p.yaml"


def test_a_missing_plan_is_refused_at_load_naming_where_it_looked_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text(_recipe_with_plan("nowhere.yaml"))
    with pytest.raises(RecipeError, match=r"plan file 'nowhere\.yaml' not found .*quantkit plan MEASUREMENT"):
        load_recipe(tmp_path / "r.yaml")


@pytest.mark.parametrize("size", ["w4-size", "w3-size", "w4-size-transformers"])
def test_the_shipped_size_plans_cover_every_smollm2_linear_and_fit_their_recipes_size_gate(size: str) -> None:
    from quantkit.mixed.plan_file import load_plan

    recipe = load_recipe(REPO / "recipes" / f"best-at-{size}.yaml")
    assert recipe.quantization.plan == str(REPO / "recipes" / "plans" / f"smollm2-135m-{size}.yaml")
    # bfloat16 where the CPU has it (measured indistinguishable from float32, and faster), float32 where emulated
    assert recipe.quantization.compute_dtype == "auto"
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    modules = [f"model.layers.{i}.self_attn.{p}" for i in range(30) for p in projections]
    modules += [f"model.layers.{i}.mlp.{p}" for i in range(30) for p in ("gate_proj", "up_proj", "down_proj")]
    plan = load_plan(Path(recipe.quantization.plan), known_modules=modules)
    assert plan.model == "smollm2-135m" and plan.unmatched == [] and len(plan.assignment) == 210
    assert plan.outer["untied_head"] and "rotation" in recipe.quantization.solvers.model_dump(exclude_none=True)
    assert plan.budget["max_size_mb"] <= recipe.gates.max_checkpoint_mb
    # transformers 5.22 loads a quantized embedding only unpacked, which takes int8 (docs/formats.md)
    embed_quant = recipe.quantization.solvers.model_dump(exclude_unset=True).get("embed_quant", {})
    assert (plan.outer["embedding"]["scheme"], embed_quant.get("layout")) == (
        ("int8", "unpacked") if size.endswith("transformers") else ("w4g64", None)
    )
    # the W4 g64 embeddings are solved under the Fisher, measured better out of domain; an int8 table has nothing to
    # gain (docs/benchmarks.md, "Measurements behind the defaults")
    assert embed_quant.get("solver") == (None if size.endswith("transformers") else "gptq")
