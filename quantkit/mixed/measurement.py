"""The saved, reusable result of ``quantkit sensitivity``: per unit, each candidate's error and exact cost.

A *unit* is what gets one scheme: a fused group (q/k/v, gate/up) or a single Linear. ``options`` maps a
candidate name (see :mod:`quantkit.mixed.candidates`) to its measured error (lower is better; "proxy": weighted
reconstruction error, "kl": KL divergence of the model output, "hybrid": proxy rescaled per unit to a measured
KL) and exact storage bits (as on disk).

File: JSON ``{"format": "quantkit-measurement", "version": 1, "model", "mode", "candidates", "units",
"metadata"}``, written to a temp name and renamed into place. :func:`load_measurement` validates everything
and names the offending entry, e.g. ``units[3].options['int4-g64'].bits``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.mixed.candidates import parse_candidate

FORMAT = "quantkit-measurement"
VERSION = 1
MODES = ("proxy", "kl", "hybrid")


@dataclass(slots=True)
class CandidateCost:
    error: float  # predicted error of this candidate on the unit (lower is better)
    bits: int  # exact storage bits of the unit's weights with this candidate


@dataclass(slots=True)
class UnitMeasurement:
    name: str  # e.g. "model.layers.3.self_attn.qkv" (fused) or a module path
    modules: list[str]  # full module names that share the unit's scheme
    params: int  # weights in the unit (sum of out * in)
    options: dict[str, CandidateCost]  # candidate name -> cost


@dataclass(slots=True)
class Measurement:
    model: str
    mode: str  # "proxy" | "kl" | "hybrid" (proxy rescaled per unit to a measured KL)
    candidates: list[str]
    units: list[UnitMeasurement]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def total_params(self) -> int:
        return sum(u.params for u in self.units)

    def validate(self, source: str = "measurement") -> None:
        """Raise QuantkitError naming the first inconsistency (same checks as loading a file)."""
        _check_measurement(self, source)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "mode": self.mode,
            "candidates": list(self.candidates),
            "units": [_unit_dict(u) for u in self.units],
            "metadata": self.metadata,
        }


def _unit_dict(unit: UnitMeasurement) -> dict[str, Any]:
    options = {name: {"error": c.error, "bits": c.bits} for name, c in unit.options.items()}
    return {"name": unit.name, "modules": list(unit.modules), "params": unit.params, "options": options}


def save_measurement(measurement: Measurement, path: Path) -> Path:
    """Validate, then write JSON atomically (temp file in the same directory, then rename)."""
    path = Path(path)
    measurement.validate(str(path))
    text = json.dumps(measurement.to_dict(), indent=1, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_measurement(path: Path) -> Measurement:
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"measurement file {path} does not exist; create it with `quantkit sensitivity`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{path} is not valid JSON ({exc}); re-run `quantkit sensitivity`") from exc
    return measurement_from_dict(data, str(path))


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _fail(source: str, where: str, problem: str) -> QuantkitError:
    return QuantkitError(f"{source}: {where} {problem}; re-run `quantkit sensitivity` or fix the file")


def _require(data: Any, key: str, kind: type | tuple[type, ...], source: str, where: str) -> Any:
    if key not in data:
        raise _fail(source, where, f"is missing the key {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise _fail(source, f"{where}.{key}" if where != "file" else key, f"must be {_kind_name(kind)}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


def measurement_from_dict(data: Any, source: str = "measurement") -> Measurement:
    """Build and validate a Measurement from parsed JSON."""
    if not isinstance(data, dict):
        raise _fail(source, "the file", "must hold a JSON object")
    if data.get("format") != FORMAT:
        raise _fail(source, "format", f"is {data.get('format')!r}, expected {FORMAT!r} (not a measurement file?)")
    if data.get("version") != VERSION:
        raise _fail(source, "version", f"is {data.get('version')!r}; this quantkit reads version {VERSION}")
    units = [
        _unit_from_dict(u, source, f"units[{i}]") for i, u in enumerate(_require(data, "units", list, source, "file"))
    ]
    measurement = Measurement(
        model=_require(data, "model", str, source, "file"),
        mode=_require(data, "mode", str, source, "file"),
        candidates=list(_require(data, "candidates", list, source, "file")),
        units=units,
        metadata=dict(data.get("metadata") or {}),
    )
    _check_measurement(measurement, source)
    return measurement


def _unit_from_dict(data: Any, source: str, where: str) -> UnitMeasurement:
    if not isinstance(data, dict):
        raise _fail(source, where, "must be an object with name, modules, params, options")
    options_raw = _require(data, "options", dict, source, where)
    options = {}
    for name, cost in options_raw.items():
        at = f"{where}.options[{name!r}]"
        if not isinstance(cost, dict):
            raise _fail(source, at, "must be an object {error, bits}")
        options[name] = CandidateCost(
            error=float(_require(cost, "error", (int, float), source, at)), bits=_require(cost, "bits", int, source, at)
        )
    return UnitMeasurement(
        name=_require(data, "name", str, source, where),
        modules=list(_require(data, "modules", list, source, where)),
        params=_require(data, "params", int, source, where),
        options=options,
    )


def _check_measurement(m: Measurement, source: str) -> None:
    if m.mode not in MODES:
        raise _fail(source, "mode", f"is {m.mode!r}; expected one of {list(MODES)}")
    if not m.candidates or len(set(m.candidates)) != len(m.candidates):
        raise _fail(source, "candidates", "must be a non-empty list of distinct candidate names")
    for name in m.candidates:
        parse_candidate(name)  # raises with the syntax for an unknown name
    if not m.units:
        raise _fail(source, "units", "is empty: nothing was measured")
    seen_units: set[str] = set()
    seen_modules: dict[str, str] = {}
    for i, unit in enumerate(m.units):
        where = f"units[{i}] ({unit.name})"
        if not unit.name or unit.name in seen_units:
            raise _fail(source, where, "needs a unique, non-empty name")
        seen_units.add(unit.name)
        _check_unit(unit, m.candidates, source, where, seen_modules)


def _check_unit(
    unit: UnitMeasurement, candidates: list[str], source: str, where: str, seen_modules: dict[str, str]
) -> None:
    if not unit.modules or not all(isinstance(x, str) and x for x in unit.modules):
        raise _fail(source, f"{where}.modules", "must be a non-empty list of module names")
    for module in unit.modules:
        if module in seen_modules:
            raise _fail(source, f"{where}.modules", f"repeats {module!r}, already in unit {seen_modules[module]!r}")
        seen_modules[module] = unit.name
    if isinstance(unit.params, bool) or not isinstance(unit.params, int) or unit.params <= 0:
        raise _fail(source, f"{where}.params", f"must be a positive integer, got {unit.params!r}")
    if not unit.options:
        raise _fail(source, f"{where}.options", "is empty: measure at least one candidate")
    for name, cost in unit.options.items():
        at = f"{where}.options[{name!r}]"
        if name not in candidates:
            raise _fail(source, at, f"is not one of the measured candidates {candidates}")
        if isinstance(cost.error, bool) or not isinstance(cost.error, (int, float)) or not math.isfinite(cost.error):
            raise _fail(source, f"{at}.error", f"must be a finite number, got {cost.error!r}")
        if isinstance(cost.bits, bool) or not isinstance(cost.bits, int) or cost.bits <= 0:
            raise _fail(source, f"{at}.bits", f"must be a positive integer, got {cost.bits!r}")
