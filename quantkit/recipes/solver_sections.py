"""The recipe's ``quantization.solvers`` mapping, generated from the registered algorithms: one optional section
per algorithm, its keys and defaults those of the algorithm's config dataclass, its values checked by the
config itself. A new algorithm is a new key here without an edit.

    solvers:            # run in their roles' order, whatever the order written
      rotation: {}      # on with its defaults (kind: hadamard)
      gptq: {damp: 0.01}
      tune: {steps: 100}

A list of names or one-key mappings (``[awq, {gptq: {damp: 0.02}}]``, as llm-compressor lists its modifiers) is
read as the mapping; ``true`` stands for ``{}`` and ``false`` or ``null`` for an algorithm left out.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from pydantic import Field, create_model, model_validator

from quantkit.errors import QuantkitError
from quantkit.quantization.methods import registry
from quantkit.quantization.methods.composition import JobSteps
from quantkit.quantization.methods.registry import Algorithm
from quantkit.schemas.fields import FileModel
from quantkit.schemas.located import LocatedDict, LocatedList
from quantkit.schemas.validate import rule_error


def _checked_by_config(algorithm: Algorithm) -> Any:
    """A model validator that builds the algorithm's config, so its own checks speak for the section."""

    def check(section: FileModel) -> FileModel:
        try:
            algorithm.config(**section.model_dump())
        except QuantkitError as exc:
            raise rule_error(str(exc)) from None
        return section

    return model_validator(mode="after")(check)


def section_model(algorithm: Algorithm) -> type[FileModel]:
    """The pydantic model of one algorithm's section."""
    return _section_model(algorithm.name)


@functools.cache
def _section_model(name: str) -> type[FileModel]:
    algorithm = registry.by_name(name)
    hints = typing.get_type_hints(algorithm.config)
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(algorithm.config):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        fields[field.name] = (hints[field.name], Field(default, description=field.metadata.get("help")))
    title = "".join(part.capitalize() for part in name.split("_")) + "Section"
    return create_model(title, __base__=FileModel, __validators__={"checked": _checked_by_config(algorithm)}, **fields)  # type: ignore[call-overload]


def _check_composition(section: FileModel) -> FileModel:
    try:
        JobSteps(configs_of(section))
    except QuantkitError as exc:
        raise rule_error(str(exc)) from None
    return section


@functools.cache
def solvers_model() -> type[FileModel]:
    """The pydantic model of the ``solvers`` mapping: every registered algorithm, each optional."""
    fields = {a.name: (section_model(a) | None, None) for a in registry.algorithms()}
    validators = {"composition": model_validator(mode="after")(_check_composition)}
    return create_model("SolversSection", __base__=FileModel, __validators__=validators, **fields)  # type: ignore[call-overload]


def configs_of(section: FileModel) -> list[Any]:
    """The algorithm configs a ``solvers`` section stands for, in role order."""
    configs = []
    for algorithm in registry.algorithms():
        sub = getattr(section, algorithm.name)
        if sub is not None:
            configs.append(algorithm.config(**sub.model_dump()))
    return configs


def sections_of(configs: list[Any]) -> dict[str, dict[str, Any]]:
    """The ``solvers`` mapping of algorithm configs (the inverse of :func:`configs_of`)."""
    return {registry.of(c).name: dataclasses.asdict(c) for c in configs}


def normalize_solvers(value: Any) -> Any:
    """The list form and the ``true``/``false`` shorthands as the mapping form, locations kept; anything else as
    it is (validation then says what is wrong)."""
    if isinstance(value, list):
        mapping = LocatedDict(where=getattr(value, "where", None))
        for index, item in enumerate(value):
            where = value.where_of(index) if isinstance(value, LocatedList) else None
            if isinstance(item, str):
                mapping[item] = LocatedDict(where=where)
                mapping.key_where[item] = where
            elif isinstance(item, dict) and len(item) == 1:
                ((key, sub),) = item.items()
                mapping[key] = sub
                mapping.key_where[key] = item.where_of(key) if isinstance(item, LocatedDict) else where
            else:
                return value
        value = mapping
    if isinstance(value, dict):
        for key in list(value):
            if value[key] is True:
                value[key] = LocatedDict(where=value.where_of(key) if isinstance(value, LocatedDict) else None)
            elif value[key] is False or value[key] is None:
                del value[key]
    return value
