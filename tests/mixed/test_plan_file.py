"""Plan YAML validation: every rule of the schema and of the model check names file:line, the key path, a hint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mixed.test_plan_io import FUSED_GROUPS, MODULES, write_plan
from quantkit.errors import QuantkitError
from quantkit.mixed.plan_file import PlanRules, load_plan

RULE0 = r"rules\[0\] \(target '[^']*'\)"


@pytest.fixture()
def plan_file(tmp_path: Path) -> Path:
    return write_plan(tmp_path)


def _edit(path: Path, pattern: str, repl: str) -> int:
    """Replace the first match of ``pattern`` (multiline regex); returns the 1-based line where it started."""
    text = path.read_text()
    match = re.search(pattern, text, flags=re.MULTILINE)
    assert match, pattern
    path.write_text(text[: match.start()] + repl + text[match.end() :])
    return text[: match.start()].count("\n") + 1


def _load(path: Path) -> PlanRules:
    return load_plan(path, known_modules=MODULES, fused_groups=FUSED_GROUPS)


def _message(path: Path) -> str:
    with pytest.raises(QuantkitError) as info:
        _load(path)
    return str(info.value)


def _assert_at(message: str, path: Path, line: int, key_path: str, hint: str) -> None:
    assert re.match(rf"{re.escape(str(path))}:{line}: {key_path}", message), (message, line)
    assert hint in message, message


def _edit_rule0(path: Path, key: str, new: str | None) -> int:
    """Replace (``new``) or delete (None) the ``key`` line of the first rule; returns the line to report."""
    lines = path.read_text().splitlines()
    first = lines.index("rules:") + 1
    index = next(i for i in range(first, len(lines)) if lines[i][2:].startswith(f"{key}:"))
    if new is None:
        del lines[index]
    else:
        lines[index] = new
    path.write_text("\n".join(lines) + "\n")
    return index + 1 if new is not None else first + 1


@pytest.mark.parametrize(
    ("key", "new", "key_path", "hint"),
    [
        ("scheme", "  shceme: int4-g64", rf"{RULE0}\.shceme", "unknown key 'shceme'; did you mean 'scheme'?"),
        ("scheme", None, rf"{RULE0}\.scheme", "missing required key 'scheme' in rules[0]"),
        ("scheme", "  scheme: int4-g46", rf"{RULE0}\.scheme", "did you mean 'int4-g64'? use int<bits>"),
        ("target", "- target: ' '", r"rules\[0\] \(target ' '\)\.target", "needs a `target`"),
        ("target", "- target: re:(q_proj", rf"{RULE0}\.target", "invalid regular expression"),
        ("bits", "  bits: many", rf"{RULE0}\.bits", "expected an integer (or null), got str 'many'"),
        ("predicted_error", "  predicted_error: high", rf"{RULE0}\.predicted_error", "expected a number (or null)"),
        ("params", "  params: true", rf"{RULE0}\.params", "expected an integer (or null), got bool True"),
    ],
    ids=["unknown-key", "missing-key", "unknown-scheme", "empty-target", "bad-regex", "bits", "error", "params"],
)
def test_rule_errors_name_file_line_path_and_hint(
    plan_file: Path, key: str, new: str | None, key_path: str, hint: str
) -> None:
    line = _edit_rule0(plan_file, key, new)
    _assert_at(_message(plan_file), plan_file, line, f"{key_path}: ", hint)


@pytest.mark.parametrize(
    ("pattern", "repl", "delta", "key_path", "hint"),
    [
        (r"^mode: ", "mdoe: ", 0, "mdoe", "unknown key 'mdoe'; did you mean 'mode'?"),
        (r"^model: .*", "model: 135", 0, "model", "expected a string, got int 135 (quote it)"),
        (r"^totals:\n(  .*\n)*", "totals: [1]\n", 0, "totals", "expected a mapping (or null), got a list"),
        (r"^rules:\n(.*\n)*", "rules: []\n", 0, "rules", "expected at least one item, got an empty list"),
        (r"^rules:\n", "rules:\n- 5\n", 1, r"rules\[0\]", "expected a mapping with keys target, scheme"),
    ],
    ids=["unknown-key", "model-type", "totals-type", "empty-rules", "rule-not-a-mapping"],
)
def test_top_level_errors_name_file_line_path_and_hint(
    plan_file: Path, pattern: str, repl: str, delta: int, key_path: str, hint: str
) -> None:
    line = _edit(plan_file, pattern, repl)
    _assert_at(_message(plan_file), plan_file, line + delta, f"{key_path}: ", hint)


def test_missing_rules_names_the_top_mapping(plan_file: Path) -> None:
    _edit(plan_file, r"^rules:\n(.*\n)*", "")
    line = plan_file.read_text().splitlines().index("model: HuggingFaceTB/SmolLM2-135M") + 1
    _assert_at(_message(plan_file), plan_file, line, "rules: ", "missing required key 'rules' in the top level")


def test_bad_yaml_names_the_line(plan_file: Path) -> None:
    line = _edit(plan_file, r"^  scheme: .*", "  scheme: int8: oops")  # "mapping values are not allowed here"
    _assert_at(_message(plan_file), plan_file, line, "invalid YAML: ", "fix the syntax there")


def test_duplicate_key_names_its_line(plan_file: Path) -> None:
    line = _edit(plan_file, r"^mode: .*\n", "mode: proxy\nmode: kl\n")
    _assert_at(_message(plan_file), plan_file, line + 1, "duplicate key 'mode'", "keep one")


def test_not_a_mapping(plan_file: Path) -> None:
    plan_file.write_text("- target: x\n  scheme: int8\n")
    _assert_at(_message(plan_file), plan_file, 1, "expected a mapping with keys model, mode", "got a list")


def test_rule_matching_no_module(plan_file: Path) -> None:
    line = _edit(plan_file, r"^- target: .*layers\\\.1\\\.self_attn\\\.o_proj.*", r"- target: model.layers.1.out_proj")
    _assert_at(
        _message(plan_file), plan_file, line, r"rule 6 \(target 'model\.layers\.1\.out_proj'\)", "matches no module"
    )


def test_module_matched_by_two_rules_with_different_schemes(plan_file: Path) -> None:
    existing = next(r for r in load_plan(plan_file).rules if "layers\\.2\\.mlp\\.down_proj" in r.target)
    other = "int8" if existing.scheme_name != "int8" else "int3-g64"
    line = len(plan_file.read_text().splitlines()) + 1
    plan_file.write_text(plan_file.read_text() + f"- target: model.layers.2.mlp.down_proj\n  scheme: {other}\n")
    message = _message(plan_file)
    _assert_at(
        message,
        plan_file,
        line,
        r"module 'model\.layers\.2\.mlp\.down_proj' is matched by rule 11 .* and rule 12",
        "narrow one target",
    )


def test_fused_members_with_different_schemes(plan_file: Path) -> None:
    line = _edit(plan_file, r"\(q_proj\|k_proj\|v_proj\)", "(q_proj|k_proj)")  # v_proj of layer 0: no rule
    with pytest.raises(QuantkitError) as info:
        load_plan(plan_file, fused_groups=FUSED_GROUPS)
    _assert_at(str(info.value), plan_file, line, "fused modules must share one scheme", "v_proj: fp16 (no rule)")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="does not exist; create it with `quantkit plan`"):
        load_plan(tmp_path / "nope.yaml")


def test_hand_edit_within_the_schema_loads(plan_file: Path) -> None:
    _edit(plan_file, r"^  scheme: .*", "  scheme: int8")
    assert _load(plan_file).rules[0].scheme_name == "int8"
