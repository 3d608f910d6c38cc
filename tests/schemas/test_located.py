"""Located YAML and JSON: the line of every key and item, duplicates, syntax errors, and the fallbacks."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import QuantkitError
from quantkit.schemas.located import (
    LocatedDict,
    LocatedList,
    format_where,
    load_json,
    load_yaml,
    locate,
    located,
    plain,
)

YAML = """\
# a comment
top: 1
nested:
  inner: [a, b]
  block:
  - x: 1
    y: 2
  - 3
flow: {k: v}
"""


class Custom(QuantkitError):
    pass


def test_yaml_keys_and_items_know_their_lines():
    data = load_yaml(YAML, "f.yaml")
    assert isinstance(data, LocatedDict) and data.where == 2
    assert data.key_where == {"top": 2, "nested": 3, "flow": 9}
    assert data["nested"].key_where == {"inner": 4, "block": 5}
    block = data["nested"]["block"]
    assert isinstance(block, LocatedList) and block.item_where == [6, 8]
    assert data["nested"]["block"][0].key_where == {"x": 6, "y": 7}
    assert plain(data) == {
        "top": 1,
        "nested": {"inner": ["a", "b"], "block": [{"x": 1, "y": 2}, 3]},
        "flow": {"k": "v"},
    }
    assert type(plain(data)) is dict and type(plain(data)["nested"]["block"]) is list


def test_locate_finds_the_deepest_known_part():
    data = load_yaml(YAML, "f.yaml")
    assert locate(data, ("nested", "block", 0, "y")) == 7
    assert locate(data, ("nested", "block", 1)) == 8
    assert locate(data, ("nested", "missing", "deeper")) == 3  # the key that exists
    assert locate(data, ("nested", "block", 5)) == 5
    assert locate(data, ()) == 2
    assert locate({"plain": 1}, ("plain",)) is None
    assert format_where("f.yaml", 7) == "f.yaml:7"
    assert format_where("f.yaml", "--set a=b") == "f.yaml (--set a=b)"
    assert format_where("f.yaml", None) == "f.yaml"


def test_yaml_duplicate_key_and_syntax_error_name_the_line():
    with pytest.raises(Custom, match=r"^f\.yaml:3: duplicate key 'a'; keep one$"):
        load_yaml("a: 1\nb: 2\na: 3\n", "f.yaml", error=Custom)
    with pytest.raises(Custom, match=r"^f\.yaml:2: invalid YAML: .*; fix the syntax there"):
        load_yaml("a: [1\nb: 2: 3\n", "f.yaml", error=Custom)
    with pytest.raises(QuantkitError, match=r"^f\.yaml:1: invalid YAML: found an unhashable key"):
        load_yaml("? [1]\n: 2\n", "f.yaml")
    assert load_yaml("", "f.yaml") is None and load_yaml("# nothing\n", "f.yaml") is None


def test_yaml_string_hook_sees_line_and_quoting():
    seen = []

    def hook(text: str, line: int, quoted: bool) -> object:
        seen.append((text, line, quoted))
        return text.upper()

    data = load_yaml("a: plain\nb: 'quoted'\nc: 5\n", "f.yaml", on_string=hook)
    assert data == {"A": "PLAIN", "B": "QUOTED", "C": 5}  # keys are strings too
    assert ("plain", 1, False) in seen and ("quoted", 2, True) in seen


def test_json_values_from_json_lines_from_yaml():
    text = json.dumps({"a": 1e-05, "b": [1, {"c": True}], "d": None, "e": "x"}, indent=1)
    data = load_json(text, "f.json")
    assert data == {"a": 1e-05, "b": [1, {"c": True}], "d": None, "e": "x"}
    assert isinstance(data["a"], float)  # YAML 1.1 would read 1e-05 as a string
    assert data.where == 1 and data.key_where == {"a": 2, "b": 3, "d": 9, "e": 10}
    assert data["b"].item_where == [4, 5] and data["b"][1].key_where == {"c": 6}


def test_json_duplicate_key_and_syntax_error_name_the_line():
    with pytest.raises(Custom, match=r"^f\.json:3: duplicate key 'a'; keep one$"):
        load_json('{\n "a": 1,\n "a": 2\n}', "f.json", error=Custom)
    with pytest.raises(QuantkitError, match=r"^f\.json:2: not valid JSON \(Expecting value\); re-run it$"):
        load_json('{"a":\n}', "f.json", fix="re-run it")


def test_json_that_yaml_cannot_compose_loads_without_lines():
    text = '{"a": {"b": [1, 2]},\n"a2"\n: 3}'  # a key and its colon on two lines: valid JSON, not YAML
    data = load_json(text, "f.json")
    assert data == {"a": {"b": [1, 2]}, "a2": 3}
    assert data.where is None and data.key_where == {} and locate(data, ("a", "b", 1)) is None
    with pytest.raises(QuantkitError, match=r"^f\.json: duplicate key 'a'"):
        load_json('{"a": 1,\n"a"\n: 2}', "f.json")


def test_located_marks_every_key_and_item():
    value = located({"a": [1, {"b": 2}]}, "--set a=b")
    assert value.where == "--set a=b" and value.key_where == {"a": "--set a=b"}
    assert value["a"].item_where == ["--set a=b", "--set a=b"] and value["a"][1].key_where == {"b": "--set a=b"}
    assert locate(value, ("a", 1, "b")) == "--set a=b"
