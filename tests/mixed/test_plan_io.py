"""Plan YAML (round trip, hand-edit validation, quantization_config groups), measurement files, the table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mixed.test_planner import FUSED, SMOL_SHAPES, smollm2_measurement
from quantkit.errors import QuantkitError
from quantkit.format.quantization_config import build_quantization_config, parse_quantization_config
from quantkit.mixed.measurement import load_measurement, measurement_from_dict, save_measurement
from quantkit.mixed.plan_file import PlanRules, dump_plan, load_plan, module_target, plan_rules, render_plan, save_plan
from quantkit.mixed.planner import plan

LAYERS = 3
MODULES = [f"model.layers.{i}.{rel}" for i in range(LAYERS) for rel in SMOL_SHAPES]
FUSED_GROUPS = [[f"model.layers.{i}.{rel}" for rel in group] for i in range(LAYERS) for group in FUSED.values()]


@pytest.fixture()
def plan_file(tmp_path: Path) -> Path:
    m = smollm2_measurement(layers=LAYERS, seed=5)
    return save_plan(plan(m, target_bits=4.6, pins=[("layers\\.0\\.mlp", "int8")]), tmp_path / "plan.yaml")


def _edit(path: Path, old: str, new: str, count: int = 1) -> Path:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, count))
    return path


def _load(path: Path) -> PlanRules:
    return load_plan(path, known_modules=MODULES, fused_groups=FUSED_GROUPS)


def test_round_trip_is_byte_identical(plan_file: Path, tmp_path: Path) -> None:
    rules = _load(plan_file)
    again = save_plan(rules, tmp_path / "again.yaml")
    assert again.read_bytes() == plan_file.read_bytes()
    assert save_plan(load_plan(again), tmp_path / "third.yaml").read_bytes() == plan_file.read_bytes()
    assert len(rules.rules) == 4 * LAYERS and rules.unmatched == []
    assert rules.budget["pins"] == [{"pattern": "layers\\.0\\.mlp", "scheme": "int8"}]


def test_rules_cover_fused_units_and_feed_quantization_config(plan_file: Path) -> None:
    m = smollm2_measurement(layers=LAYERS, seed=5)
    chosen = plan(m, target_bits=4.6, pins=[("layers\\.0\\.mlp", "int8")])
    rules = _load(plan_file)
    groups, ignore = rules.groups(), rules.ignore()
    layout = parse_quantization_config(build_quantization_config(groups, ignore))
    for unit in chosen.units:
        schemes = {layout.scheme_for(module) for module in unit.modules}
        assert schemes == {unit.scheme}  # every member of a fused unit gets the unit's candidate
    listed = [name for _, names in groups for name in names] + ignore
    assert sorted(listed) == sorted(MODULES)


def test_module_target_matches_exactly_its_modules() -> None:
    target = module_target([f"model.layers.3.{rel}" for rel in FUSED["qkv"]])
    assert target == r"re:^model\.layers\.3\.self_attn\.(q_proj|k_proj|v_proj)$"
    regex = re.compile(target[3:])
    assert regex.match("model.layers.3.self_attn.k_proj")
    assert not regex.match("model.layers.30.self_attn.k_proj") and not regex.match("model.layers.3.self_attn.o_proj")
    assert module_target(["lm_head"]) == "re:^lm_head$"


def test_unknown_scheme_suggests_the_closest(plan_file: Path) -> None:
    first = load_plan(plan_file).rules[0].scheme_name
    _edit(plan_file, f"v_proj)$\n  scheme: {first}\n", "v_proj)$\n  scheme: int4-g46\n")
    with pytest.raises(QuantkitError, match=r"plan\.yaml: rule 0 .*unknown scheme 'int4-g46'; did you mean 'int4-g64'"):
        _load(plan_file)


def test_bad_yaml_names_the_line(plan_file: Path) -> None:
    lines = plan_file.read_text().splitlines()
    bad = next(i for i, line in enumerate(lines) if line.startswith("rules:")) + 2
    lines[bad] = lines[bad] + ": oops"  # "mapping values are not allowed here"
    plan_file.write_text("\n".join(lines) + "\n")
    with pytest.raises(QuantkitError, match=rf"plan\.yaml: invalid YAML at line {bad + 1}"):
        _load(plan_file)


def test_invalid_regex(plan_file: Path) -> None:
    _edit(plan_file, "(q_proj|k_proj|v_proj)$", "(q_proj|k_proj|v_proj$")
    with pytest.raises(QuantkitError, match=r"plan\.yaml: rule 0 .*invalid regular expression"):
        _load(plan_file)


def test_rule_matching_no_module(plan_file: Path) -> None:
    _edit(plan_file, r"layers\.1\.self_attn\.o_proj", r"layers\.1\.self_attn\.out_proj")
    with pytest.raises(QuantkitError, match=r"rule 6 .*out_proj.* matches no module"):
        _load(plan_file)


def test_module_matched_by_two_rules_with_different_schemes(plan_file: Path) -> None:
    existing = next(r for r in load_plan(plan_file).rules if "layers\\.2\\.mlp\\.down_proj" in r.target)
    other = "int8" if existing.scheme_name != "int8" else "int3-g64"
    plan_file.write_text(plan_file.read_text() + f"- target: model.layers.2.mlp.down_proj\n  scheme: {other}\n")
    with pytest.raises(QuantkitError, match=r"'model\.layers\.2\.mlp\.down_proj' is matched by rule 11 .* and rule 12"):
        _load(plan_file)


def test_fused_members_with_different_schemes(plan_file: Path) -> None:
    _edit(plan_file, "(q_proj|k_proj|v_proj)", "(q_proj|k_proj)")  # v_proj of layer 0 no longer covered
    with pytest.raises(QuantkitError, match=r"fused modules must share one scheme.*v_proj: fp16 \(no rule\)"):
        load_plan(plan_file, fused_groups=FUSED_GROUPS)


def test_unknown_rule_key(plan_file: Path) -> None:
    _edit(plan_file, "v_proj)$\n  scheme:", "v_proj)$\n  shceme:")
    with pytest.raises(QuantkitError, match=r"rule 0 .*unknown key\(s\) \['shceme'\]"):
        _load(plan_file)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="does not exist; create it with `quantkit plan`"):
        load_plan(tmp_path / "nope.yaml")


def test_measurement_round_trip_and_validation(tmp_path: Path) -> None:
    m = smollm2_measurement(layers=2)
    path = save_measurement(m, tmp_path / "sens.json")
    assert load_measurement(path) == m
    assert [p.name for p in tmp_path.iterdir()] == ["sens.json"]  # no temp file left behind
    data = json.loads(path.read_text())
    data["units"][3]["options"]["int4-g64"]["bits"] = -5
    with pytest.raises(QuantkitError, match=r"units\[3\] \(model\.layers\.0\.down_proj\)\.options\['int4-g64'\]\.bits"):
        measurement_from_dict(data, "sens.json")
    data = json.loads(path.read_text())
    data["units"][1]["modules"] = data["units"][0]["modules"][:1]
    with pytest.raises(QuantkitError, match=r"repeats 'model\.layers\.0\.self_attn\.q_proj'"):
        measurement_from_dict(data)
    data = json.loads(path.read_text())
    data["mode"] = "mse"
    with pytest.raises(QuantkitError, match=r"mode is 'mse'; expected one of \['proxy', 'kl', 'hybrid'\]"):
        measurement_from_dict(data)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(QuantkitError, match="not valid JSON"):
        load_measurement(tmp_path / "bad.json")


def test_render_plan_and_dump(plan_file: Path) -> None:
    pytest.importorskip("rich")
    chosen = plan(smollm2_measurement(layers=LAYERS, seed=5), target_bits=4.6)
    table = render_plan(chosen)
    assert table.row_count == 4 * LAYERS
    assert [c.header for c in table.columns] == ["unit", "scheme", "bits/w", "predicted error"]
    assert f"{chosen.bits_per_weight:.3f} bits/w" in str(table.caption)
    assert dump_plan(chosen) == dump_plan(plan_rules(chosen))
