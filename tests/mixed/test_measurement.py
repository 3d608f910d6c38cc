"""Measurement JSON: round trip, and every validation rule naming file:line, the entry's path and a hint."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mixed.test_planner import smollm2_measurement
from quantkit.errors import QuantkitError
from quantkit.mixed.measurement import load_measurement, measurement_from_dict, save_measurement

UNIT3 = r"units\[3\] \(model\.layers\.0\.down_proj\)"
UNIT1 = r"units\[1\] \(model\.layers\.0\.gate_up\)"
FIX = "re-run `quantkit sensitivity` or fix the file"


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    return save_measurement(smollm2_measurement(layers=2), tmp_path / "sens.json")


def test_round_trip_and_no_temp_file(saved: Path) -> None:
    m = smollm2_measurement(layers=2)
    assert load_measurement(saved) == m
    assert [p.name for p in saved.parent.iterdir()] == ["sens.json"]  # no temp file left behind
    assert saved.read_text() == json.dumps(m.to_dict(), indent=1) + "\n"


def _write(path: Path, data: Any) -> list[str]:
    text = json.dumps(data, indent=1)
    path.write_text(text)
    return text.splitlines()


def _line_of(lines: list[str], marker: str) -> int:
    """1-based line of ``marker``: ``"A|B"`` is the first line holding B after the first holding A; a leading
    ``^`` means the line above (where a list item's object starts)."""
    index = -1
    for part in marker.removeprefix("^").split("|"):
        index = next(i for i in range(index + 1, len(lines)) if part in lines[i])
    return index + 1 - marker.startswith("^")


def _cost(data: dict[str, Any]) -> dict[str, Any]:
    return data["units"][3]["options"]["int4-g64"]


CASES = [
    # (edit of the saved data, marker of the reported line (see _line_of), key path, hint)
    pytest.param(
        lambda d: _cost(d).update(bits=-5),
        '"bits": -5',
        rf"{UNIT3}\.options\['int4-g64'\]\.bits",
        "expected a value > 0, got -5",
        id="bits-positive",
    ),
    pytest.param(
        lambda d: _cost(d).update(bits=1.5),
        '"bits": 1.5',
        rf"{UNIT3}\.options\['int4-g64'\]\.bits",
        "expected an integer, got float 1.5",
        id="bits-type",
    ),
    pytest.param(
        lambda d: _cost(d).update(error=math.inf),
        "Infinity",
        rf"{UNIT3}\.options\['int4-g64'\]\.error",
        "expected a finite number, got inf",
        id="error-finite",
    ),
    pytest.param(
        lambda d: _cost(d).update(errr=1),
        '"errr"',
        rf"{UNIT3}\.options\['int4-g64'\]\.errr",
        "did you mean 'error'?",
        id="cost-unknown-key",
    ),
    pytest.param(
        lambda d: _cost(d).pop("bits"),
        '"model.layers.0.down_proj"|"int4-g64"',
        rf"{UNIT3}\.options\['int4-g64'\]\.bits",
        "missing required key 'bits'",
        id="cost-missing-key",
    ),
    pytest.param(
        lambda d: d["units"][3]["options"].update({"int4-g64": 5}),
        '"int4-g64": 5',
        rf"{UNIT3}\.options\['int4-g64'\]",
        "expected a mapping with keys error, bits, got int 5",
        id="cost-not-object",
    ),
    pytest.param(
        lambda d: d["units"][1]["options"].update({"int2": {"error": 1.0, "bits": 3}}),
        '"int2"',
        rf"{UNIT1}\.options\['int2'\]",
        "is not one of the measured candidates",
        id="option-unmeasured",
    ),
    pytest.param(
        lambda d: d["units"][1].update(options={}),
        '"options": {}',
        rf"{UNIT1}\.options",
        "expected at least one item",
        id="options-empty",
    ),
    pytest.param(
        lambda d: d["units"][1].update(modules=d["units"][0]["modules"][:1]),
        '"units"|"model.layers.0.gate_up"|q_proj',
        rf"{UNIT1}\.modules\[0\]",
        "repeats 'model.layers.0.self_attn.q_proj', already in unit 'model.layers.0.qkv'",
        id="module-twice",
    ),
    pytest.param(
        lambda d: d["units"][1].update(modules=[]),
        '"modules": []',
        rf"{UNIT1}\.modules",
        "expected at least one item, got an empty list",
        id="modules-empty",
    ),
    pytest.param(
        lambda d: d["units"][1].update(modules=[""]),
        '""',
        rf"{UNIT1}\.modules\[0\]",
        "expected a non-empty string",
        id="module-name-empty",
    ),
    pytest.param(
        lambda d: d["units"][1].update(name=d["units"][0]["name"]),
        '"units"|"model.layers.0.qkv"|"model.layers.0.qkv"',
        r"units\[1\] \(model\.layers\.0\.qkv\)\.name",
        "needs a unique name; units[0] has it too",
        id="unit-name-unique",
    ),
    pytest.param(
        lambda d: d["units"][1].update(params=0),
        '"params": 0',
        rf"{UNIT1}\.params",
        "expected a value > 0, got 0",
        id="params-positive",
    ),
    pytest.param(
        lambda d: d["units"][1].pop("params"),
        '^"units"|"model.layers.0.gate_up"',
        rf"{UNIT1}\.params",
        "missing required key 'params' in units[1]",
        id="unit-missing-key",
    ),
    pytest.param(
        lambda d: d.update(mode="hybird"),
        '"mode"',
        "mode",
        "expected one of proxy, kl, hybrid, got 'hybird'; did you mean 'hybrid'?",
        id="mode-choice",
    ),
    pytest.param(
        lambda d: d.update(format="quantkit-plan"),
        '"format"',
        "format",
        "expected 'quantkit-measurement', got 'quantkit-plan' (not a measurement file?)",
        id="format",
    ),
    pytest.param(
        lambda d: d.update(version=2), '"version"', "version", "is 2; this quantkit reads version 1", id="version"
    ),
    pytest.param(
        lambda d: d["candidates"].append("int8"),
        '"candidates"|"int8"|"int8"',
        r"candidates\[5\]",
        "repeats 'int8'; list each candidate once",
        id="candidate-twice",
    ),
    pytest.param(
        lambda d: d["candidates"].__setitem__(0, "int4-g6"),
        '"int4-g6"',
        r"candidates\[0\]",
        "unknown candidate 'int4-g6'; use int<bits>",
        id="candidate-unknown",
    ),
    pytest.param(
        lambda d: d.update(units=[]),
        '"units"',
        "units",
        "expected at least one item, got an empty list",
        id="units-empty",
    ),
    pytest.param(
        lambda d: d.pop("model"), "{", "model", "missing required key 'model' in the top level", id="missing-key"
    ),
    pytest.param(
        lambda d: d.update(metdata={}),
        '"metdata"',
        "metdata",
        "unknown key 'metdata'; did you mean 'metadata'?",
        id="unknown-key",
    ),
    pytest.param(
        lambda d: d.update(model=5), '"model"', "model", "expected a string, got int 5 (quote it)", id="model-type"
    ),
]


@pytest.mark.parametrize(("edit", "marker", "key_path", "hint"), CASES)
def test_errors_name_file_line_path_and_hint(
    saved: Path, edit: Callable[[dict[str, Any]], Any], marker: str, key_path: str, hint: str
) -> None:
    data = json.loads(saved.read_text())
    edit(data)
    lines = _write(saved, data)
    line = _line_of(lines, marker)
    with pytest.raises(QuantkitError) as info:
        load_measurement(saved)
    message = str(info.value)
    assert re.match(rf"{re.escape(str(saved))}:{line}: {key_path}: ", message), (message, line)
    assert hint in message and message.endswith(FIX), message


def test_invalid_json_names_the_line(saved: Path) -> None:
    saved.write_text('{\n "format": "quantkit-measurement",\n "version": \n}\n')
    with pytest.raises(QuantkitError, match=rf"^{re.escape(str(saved))}:4: not valid JSON \(Expecting value\)"):
        load_measurement(saved)
    saved.write_bytes(b"\xff\xfe{")
    with pytest.raises(QuantkitError, match="not valid JSON"):
        load_measurement(saved)


def test_duplicate_key_names_its_line(saved: Path) -> None:
    saved.write_text('{\n "model": "a",\n "model": "b"\n}\n')
    with pytest.raises(QuantkitError, match=rf"^{re.escape(str(saved))}:3: duplicate key 'model'; keep one"):
        load_measurement(saved)


def test_not_an_object(saved: Path) -> None:
    saved.write_text("[1, 2]\n")
    with pytest.raises(
        QuantkitError, match=rf"^{re.escape(str(saved))}:1: expected a mapping with keys format, version"
    ):
        load_measurement(saved)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="does not exist; create it with `quantkit sensitivity`"):
        load_measurement(tmp_path / "nope.json")


def test_dict_and_in_memory_checks_have_no_line() -> None:
    m = smollm2_measurement(layers=2)
    data = m.to_dict()
    data["mode"] = "mse"
    with pytest.raises(QuantkitError, match=r"^sens\.json: mode: expected one of proxy, kl, hybrid, got 'mse'"):
        measurement_from_dict(data, "sens.json")
    m.units[3].options["int4-g64"].bits = 0
    with pytest.raises(
        QuantkitError, match=rf"^measurement: {UNIT3}\.options\['int4-g64'\]\.bits: expected a value > 0"
    ):
        m.validate()
    with pytest.raises(QuantkitError, match=r"^out\.json: units\[3\]"):
        save_measurement(m, Path("out.json"))  # validated before anything is written
