"""Plan YAML round trip, quantization_config groups and the table (validation: test_plan_file.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mixed.test_planner import FUSED, SMOL_SHAPES, smollm2_measurement
from quantkit.format.quantization_config import build_quantization_config, parse_quantization_config
from quantkit.mixed.plan_file import PlanRules, dump_plan, load_plan, module_target, plan_rules, render_plan, save_plan
from quantkit.mixed.planner import plan

LAYERS = 3
MODULES = [f"model.layers.{i}.{rel}" for i in range(LAYERS) for rel in SMOL_SHAPES]
FUSED_GROUPS = [[f"model.layers.{i}.{rel}" for rel in group] for i in range(LAYERS) for group in FUSED.values()]


def write_plan(directory: Path) -> Path:
    """A planned SmolLM2-shaped model (3 layers, layer 0's MLP pinned to int8) saved as ``plan.yaml``."""
    m = smollm2_measurement(layers=LAYERS, seed=5)
    return save_plan(plan(m, target_bits=4.6, pins=[("layers\\.0\\.mlp", "int8")]), directory / "plan.yaml")


@pytest.fixture()
def plan_file(tmp_path: Path) -> Path:
    return write_plan(tmp_path)


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


def test_render_plan_and_dump(plan_file: Path) -> None:
    chosen = plan(smollm2_measurement(layers=LAYERS, seed=5), target_bits=4.6)
    table = render_plan(chosen)
    assert table.row_count == 4 * LAYERS
    assert [c.header for c in table.columns] == ["unit", "scheme", "bits/w", "predicted error"]
    assert f"{chosen.bits_per_weight:.3f} bits/w" in str(table.caption)
    assert dump_plan(chosen) == dump_plan(plan_rules(chosen))
