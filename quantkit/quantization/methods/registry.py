"""The one registry of quantization algorithms: each registers its config type, its role in a run, its capabilities
and its hooks, from its own module (``quantkit/quantization/methods/<name>.py``).

A job is a list of algorithm configs (``[RotationConfig(kind="hadamard"), GPTQConfig(), TuneConfig()]``, as
llm-compressor composes modifiers). The block loop never names an algorithm: it asks the registry for the job's
algorithms in :class:`Role` order and calls the hook each role has (:mod:`quantkit.quantization.methods.hooks`).
The CLI options, the recipe schema, the fingerprint and the run log are derived from the registered config
dataclasses and the field metadata :func:`option` attaches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from quantkit.errors import QuantkitError


class Role(IntEnum):
    """Where an algorithm acts in a run; a job's algorithms run in this order."""

    ROTATION = 0  # folded into the float model before any block is solved
    TRANSFORM = 1  # rewrites a float block (on its calibration input) before its weights are solved
    SOLVER = 2  # turns a stage's linears into integer codes; a job has exactly one
    TARGET = 3  # changes what the solver fits (the weights it is handed)
    TUNE = 4  # adjusts a solved block to its float output
    HEAD = 5  # after the last block, on the tensors outside the blocks


@dataclass(frozen=True)
class Capabilities:
    """What an algorithm needs from a run, and what it leaves in the run log."""

    needs_calibration: bool = True  # activations of calibration windows (False: data-free)
    needs_hessian: bool = False  # the stage's input Hessian (solvers)
    needs_float_path: bool = False  # the float model's activations, carried beside the quantized ones
    reads_solved_block: bool = False  # runs the solved block again after its stages (its dense weights stay)
    loads_float32: bool = False  # wants block weights as float32 even where the solver would not
    unties_head: bool = False  # the checkpoint gets a head of its own
    requires: tuple[str, ...] = ()  # algorithms (by name) the job must also hold
    records: tuple[type, ...] = ()  # the run-log record types it writes
    # the scheme options a method containing it defaults to (symmetric, act_order, static_groups, mse_clip);
    # transforms are applied after the solver, so their choice wins (AWQ: asymmetric, no MSE clipping)
    scheme_defaults: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Switch:
    """How flat options (the CLI's) turn an algorithm on: by the method spelling (``method``), by a boolean flag
    of its own (``flag``), or by one of its fields holding any value but the one that means off (``field`` and
    ``off``: ``--tune-steps 0``, ``--rotate none``)."""

    kind: str  # "method", "flag" or "field"
    flag: str = ""  # kind "flag": the option, e.g. "--refit-head"
    help: str = ""  # kind "flag": its help
    field: str = ""  # kind "field": the field that switches it, e.g. "steps"
    off: Any = None  # kind "field": the value that means off (the CLI option's default: off unless asked)

    def is_on(self, config: Any) -> bool:
        """Whether ``config`` (of this algorithm) does anything; an inactive config is dropped from a job."""
        return self.kind != "field" or getattr(config, self.field) != self.off


@dataclass(frozen=True)
class Algorithm:
    name: str  # the spelling in method names, recipes and logs: "gptq"
    config: type  # its config dataclass; the defaults are quantkit's defaults
    role: Role
    caps: Capabilities
    hooks: Any  # the role's hook object (see methods.hooks)
    switch: Switch
    summary: str  # one line for --help and the docs


_REGISTRY: dict[str, Algorithm] = {}


def register(
    name: str, config: type, role: Role, hooks: Any, *, switch: Switch, summary: str, caps: Capabilities | None = None
) -> Algorithm:
    """Register an algorithm (once, from its own module) and return it."""
    algorithm = Algorithm(name, config, role, caps or Capabilities(), hooks, switch, summary)
    if not dataclasses.is_dataclass(algorithm.config):
        raise TypeError(f"{algorithm.name}: its config must be a dataclass")
    for known in _REGISTRY.values():
        if known.name == algorithm.name or known.config is algorithm.config:
            raise TypeError(f"{algorithm.name} is registered twice")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def algorithms() -> list[Algorithm]:
    """Every registered algorithm, in role order (registration order within a role)."""
    return sorted(_REGISTRY.values(), key=lambda a: a.role)


def by_name(name: str) -> Algorithm:
    found = _REGISTRY.get(name)
    if found is None:
        raise QuantkitError(f"unknown algorithm '{name}'; use one of {', '.join(a.name for a in algorithms())}")
    return found


def of(config: Any) -> Algorithm:
    """The algorithm a config object belongs to."""
    for algorithm in _REGISTRY.values():
        if type(config) is algorithm.config:
            return algorithm
    known = ", ".join(a.config.__name__ for a in algorithms())
    raise QuantkitError(f"{type(config).__name__} is not a quantization algorithm's config; use one of {known}")


def option(default: Any, help: str, *, flag: str = "", cli: bool = True, **kw: Any) -> Any:
    """A config field with its user-facing help, and the CLI flag when it is not ``--<algorithm>-<field>``;
    ``cli=False`` keeps it out of the command line (recipes and the Python API still set it)."""
    metadata = {"help": help, "flag": flag, "cli": cli}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)
