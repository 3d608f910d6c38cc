"""Validation errors: one message with file:line, the key path, expected vs found, and "did you mean"."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from pydantic import AfterValidator, Field, model_validator

from quantkit.errors import QuantkitError
from quantkit.schemas.fields import FileModel, Regex, one_of
from quantkit.schemas.located import load_json, load_yaml
from quantkit.schemas.validate import error_at, rule_error, validate


def _even(value: int) -> int:
    if value % 2:
        raise ValueError(f"expected an even number, got {value}")
    return value


class Item(FileModel):
    name: str
    size: Annotated[int, AfterValidator(_even)] = 2


class Doc(FileModel):
    colour: one_of(("red", "green", "blue")) = "red"
    items: list[Item] = Field(default_factory=list)
    tags: dict[Regex, float] = Field(default_factory=dict)
    ratio: float | None = Field(None, ge=0, le=1)
    extra: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> Doc:
        names = [item.name for item in self.items]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise rule_error(f"repeats {name!r}", "items", i, "name")
        return self


class Oops(QuantkitError):
    pass


def _message(text: str, **kwargs: Any) -> str:
    with pytest.raises(Oops) as info:
        validate(Doc, load_yaml(text, "d.yaml"), "d.yaml", error=Oops, **kwargs)
    return str(info.value)


def test_valid_data_gives_the_model():
    doc = validate(Doc, load_yaml("colour: blue\nitems: [{name: a, size: 4}]\ntags: {'x+': 1}\n", "d.yaml"), "d")
    assert doc.colour == "blue" and doc.items[0].size == 4 and doc.tags == {"x+": 1.0}


def test_choice_suggests_the_closest_or_lists_them():
    assert _message("ratio: 0.5\ncolour: gren\n") == (
        "d.yaml:2: colour: expected one of red, green, blue, got 'gren'; did you mean 'green'?"
    )
    assert _message("colour: purple\n") == "d.yaml:1: colour: expected one of red, green, blue, got 'purple'"


def test_unknown_key_comes_first_with_a_suggestion():
    message = _message("ratio: 7\nitems:\n- {name: a, sise: 4}\n")
    assert message == "d.yaml:3: items[0].sise: unknown key 'sise'; did you mean 'size'?"
    assert _message("zzz: 1\n").endswith("unknown key 'zzz'; valid keys here: colour, items, tags, ratio, extra")


def test_types_ranges_and_validators_in_file_order():
    assert _message("ratio: 7\nitems: 3\n") == "d.yaml:1: ratio: expected a value <= 1, got 7"
    assert _message("items: 3\n") == ("d.yaml:1: items: expected a list of mappings with keys name, size, got int 3")
    assert _message("items:\n- name: a\n  size: 3\n") == "d.yaml:3: items[0].size: expected an even number, got 3"
    assert _message("items:\n- size: 2\n") == "d.yaml:2: items[0].name: missing required key 'name' in items[0]"
    assert _message("extra: [1]\n") == "d.yaml:1: extra: expected a mapping (or null), got a list"


def test_mapping_keys_and_values_are_bracketed():
    assert _message("tags:\n  ok: 1\n  'a(': 2\n").startswith("d.yaml:3: tags['a('] (key): 'a(' is not a valid")
    assert _message("tags:\n  ok: x\n") == "d.yaml:2: tags['ok']: expected a number, got str 'x'"


def test_model_rule_points_at_its_key_and_items_get_labels():
    text = "items:\n- name: a\n- name: b\n- name: a\n"
    assert _message(text) == "d.yaml:4: items[2].name: repeats 'a'"
    labelled = _message(text, item_labels={"items": "item {name}"}, fix="rename one")
    assert labelled == "d.yaml:4: items[2] (item a).name: repeats 'a'; rename one"


def test_json_and_plain_data():
    with pytest.raises(QuantkitError, match=r"^d\.json:3: ratio: expected a number \(or null\), got str '1e-05'"):
        validate(Doc, load_json('{\n "colour": "red",\n "ratio": "1e-05"\n}', "d.json"), "d.json")
    assert validate(Doc, load_json('{"ratio": 1e-05}', "d.json"), "d.json").ratio == 1e-05
    with pytest.raises(QuantkitError, match=r"^mem: colour: expected one of"):
        validate(Doc, {"colour": 5}, "mem")


def test_error_at_places_a_later_check():
    data = load_yaml("items:\n- name: a\n- name: b\n", "d.yaml")
    assert str(error_at("d.yaml", data, ("items", 1), "rule 1 is wrong", error=Oops)) == "d.yaml:3: rule 1 is wrong"
