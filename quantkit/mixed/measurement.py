"""The saved, reusable result of ``quantkit sensitivity``: per unit, each candidate's error and exact cost.

A *unit* is what gets one scheme: a fused group (q/k/v, gate/up) or a single Linear. ``options`` maps a
candidate name (see :mod:`quantkit.mixed.candidates`) to its measured error (lower is better; "proxy": weighted
reconstruction error, "kl": KL divergence of the model output, "hybrid": proxy rescaled per unit to a measured
KL) and exact storage bits (as on disk).

File: JSON ``{"format": "quantkit-measurement", "version": 1, "model", "mode", "candidates", "units",
"metadata"}`` and, from ``quantkit sensitivity --outer``, ``"outer"``: the head and the embedding as units whose
options are ``--quantize-head`` spellings ("none": float; a file without the key has no outer units), written to a
temp name and renamed into place. :class:`MeasurementFile` is its schema;
:func:`load_measurement` validates everything and names the line and the offending entry, e.g.
``sens.json:57: units[3] (model.layers.0.mlp.down_proj).options['int4-g64'].bits``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from quantkit.atomic import write_text
from quantkit.errors import QuantkitError
from quantkit.mixed.candidates import parse_candidate
from quantkit.schemas.fields import FileModel, one_of
from quantkit.schemas.located import load_json, plain
from quantkit.schemas.validate import rule_error, validate

FORMAT = "quantkit-measurement"
VERSION = 1
MODES = ("proxy", "kl", "hybrid")
# metadata key of a measurement taken on the rotated model (`sensitivity --rotate`): the rotation's run-log entry
ROTATION_KEY = "rotation"
OUTER_NAMES = ("head", "embedding")  # the units outside the blocks that `sensitivity --outer` measures
# The default mode of `quantkit sensitivity`, the Python API and recipes (SensitivityConfig.mode): hybrid plans beat
# the best fitting uniform scheme at every budget of the sweep, while proxy plans, quicker to measure, lose to
# uniform schemes at low budgets (the sweep is in docs/benchmarks.md, "Mixed precision").
DEFAULT_MODE = "hybrid"
MODE_HELP = (
    "hybrid (default: the proxy rescaled per unit to one measured KL; its plans beat uniform schemes), "
    "proxy (the fast option, about half the time: Hessian-weighted error only, no full-model forward; its errors do "
    "not compare across layers, so its plans lose to uniform schemes below ~5 bits/weight) or kl (final-logit KL "
    "per candidate, slowest)"
)
_FIX = "re-run `quantkit sensitivity` or fix the file"
_ITEM_LABELS = {"units": "{name}"}


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
class OuterMeasurement:
    """The head or the embedding as a unit: options keyed by ``--quantize-head`` spellings ("none": float)."""

    name: str  # "head" | "embedding"
    module: str  # e.g. "lm_head", "model.embed_tokens"
    params: int
    options: dict[str, CandidateCost]


@dataclass(slots=True)
class Measurement:
    model: str
    mode: str  # "proxy" | "kl" | "hybrid" (proxy rescaled per unit to a measured KL)
    candidates: list[str]
    units: list[UnitMeasurement]
    metadata: dict[str, Any] = field(default_factory=dict)
    outer: list[OuterMeasurement] = field(default_factory=list)  # sensitivity --outer: the head and the embedding

    def outer_unit(self, name: str) -> OuterMeasurement | None:
        return next((o for o in self.outer if o.name == name), None)

    @property
    def rotation(self) -> dict[str, Any] | None:
        """The rotation the units were measured under (``sensitivity --rotate``), or None: the model as it is."""
        return self.metadata.get(ROTATION_KEY)

    @property
    def total_params(self) -> int:
        return sum(u.params for u in self.units)

    def validate(self, source: str = "measurement") -> None:
        """Raise QuantkitError naming the first inconsistency (same checks as loading a file)."""
        validate(MeasurementFile, self.to_dict(), source, fix=_FIX, item_labels=_ITEM_LABELS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "mode": self.mode,
            "candidates": list(self.candidates),
            "units": [_unit_dict(u) for u in self.units],
            "metadata": self.metadata,
        } | ({"outer": [_unit_dict(o) for o in self.outer]} if self.outer else {})


def _unit_dict(unit: UnitMeasurement | OuterMeasurement) -> dict[str, Any]:
    options = {name: {"error": c.error, "bits": c.bits} for name, c in unit.options.items()}
    where = {"module": unit.module} if isinstance(unit, OuterMeasurement) else {"modules": list(unit.modules)}
    return {"name": unit.name, **where, "params": unit.params, "options": options}


# --------------------------------------------------------------------------------------------------
# The file schema
# --------------------------------------------------------------------------------------------------


def _known_candidate(name: str) -> str:
    parse_candidate(name)  # raises (a ValueError) with the candidate syntax for an unknown name
    return name


CandidateName = Annotated[str, AfterValidator(_known_candidate)]
_Name = Annotated[str, Field(min_length=1)]
_Format = one_of([FORMAT])
_Version = one_of([VERSION])
_Mode = one_of(MODES)
_OuterName = one_of(OUTER_NAMES)


class CostEntry(FileModel):
    error: float = Field(allow_inf_nan=False)
    bits: int = Field(gt=0)


class UnitEntry(FileModel):
    name: _Name
    modules: list[_Name] = Field(min_length=1)
    params: int = Field(gt=0)
    options: dict[str, CostEntry] = Field(min_length=1)


def outer_spelling(name: str) -> str:
    """A head or embedding scheme as ``--quantize-head`` spells it, checked (pydantic's validator)."""
    from quantkit.quantization.methods.head_quant import head_scheme  # the one spelling of head schemes

    try:
        head_scheme(name, "rtn")
    except QuantkitError as exc:
        raise ValueError(str(exc)) from None
    return name


class OuterEntry(FileModel):
    name: _OuterName
    module: _Name
    params: int = Field(gt=0)
    options: dict[Annotated[str, AfterValidator(outer_spelling)], CostEntry] = Field(min_length=1)


class MeasurementFile(FileModel):
    format: _Format
    version: _Version
    model: str
    mode: _Mode
    candidates: list[CandidateName] = Field(min_length=1)
    units: list[UnitEntry] = Field(min_length=1)
    metadata: dict[str, Any] | None = None
    outer: list[OuterEntry] | None = None  # absent in files from before `sensitivity --outer`

    @model_validator(mode="before")
    @classmethod
    def _format_first(cls, data: Any) -> Any:
        """A file of another format or version is reported as such, before any of its other keys."""
        if isinstance(data, dict) and data.get("format") != FORMAT:
            raise rule_error(f"expected {FORMAT!r}, got {data.get('format')!r} (not a measurement file?)", "format")
        if isinstance(data, dict) and data.get("version") != VERSION:
            raise rule_error(f"is {data.get('version')!r}; this quantkit reads version {VERSION}", "version")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> MeasurementFile:
        """Distinct candidates, unique unit names, each module in one unit, options among the candidates."""
        for i, name in enumerate(self.candidates):
            if name in self.candidates[:i]:
                raise rule_error(f"repeats {name!r}; list each candidate once", "candidates", i)
        unit_of_name: dict[str, int] = {}
        unit_of_module: dict[str, str] = {}
        for i, unit in enumerate(self.units):
            if unit.name in unit_of_name:
                message = f"needs a unique name; units[{unit_of_name[unit.name]}] has it too"
                raise rule_error(message, "units", i, "name")
            unit_of_name[unit.name] = i
            for j, module in enumerate(unit.modules):
                if module in unit_of_module:
                    message = f"repeats {module!r}, already in unit {unit_of_module[module]!r}"
                    raise rule_error(message, "units", i, "modules", j)
                unit_of_module[module] = unit.name
            for name in unit.options:
                if name not in self.candidates:
                    message = f"is not one of the measured candidates {self.candidates}"
                    raise rule_error(message, "units", i, "options", name)
        for i, entry in enumerate(self.outer or []):
            if any(other.name == entry.name for other in (self.outer or [])[:i]):
                raise rule_error(f"repeats the {entry.name} unit; measure it once", "outer", i, "name")
        return self


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def save_measurement(measurement: Measurement, path: Path) -> Path:
    """Validate, then write JSON atomically (:func:`quantkit.atomic.write_text`); returns ``path``."""
    path = Path(path)
    measurement.validate(str(path))
    write_text(path, json.dumps(measurement.to_dict(), indent=1, allow_nan=False) + "\n")
    return path


def load_measurement(path: Path) -> Measurement:
    """The validated measurement in ``path``; errors name ``path:line`` and the entry."""
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"measurement file {path} does not exist; create it with `quantkit sensitivity`")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise QuantkitError(f"{path} is not valid JSON ({exc}); re-run `quantkit sensitivity`") from exc
    return measurement_from_dict(load_json(text, str(path), fix="re-run `quantkit sensitivity`"), str(path))


def measurement_from_dict(data: Any, source: str = "measurement") -> Measurement:
    """The Measurement of parsed JSON (a located tree gives errors their line); raises QuantkitError."""
    checked = validate(MeasurementFile, data, source, fix=_FIX, item_labels=_ITEM_LABELS)
    units = [
        UnitMeasurement(
            u.name, list(u.modules), u.params, {k: CandidateCost(c.error, c.bits) for k, c in u.options.items()}
        )
        for u in checked.units
    ]
    outer = [
        OuterMeasurement(o.name, o.module, o.params, {k: CandidateCost(c.error, c.bits) for k, c in o.options.items()})
        for o in checked.outer or []
    ]
    metadata = plain(checked.metadata or {})
    return Measurement(checked.model, checked.mode, list(checked.candidates), units, metadata, outer)
