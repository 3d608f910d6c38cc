"""How algorithms compose into a job: the checked, ordered list of steps, the method spellings users type
(``awq+gptq``), and the scheme options a method defaults to.

A method spelling names the transforms and the weight solver of a job, joined by ``+``; a spelling without a
solver gets :data:`IMPLIED_SOLVER` (``awq`` is AWQ's scales and clipping, then round-to-nearest, as AutoAWQ).
Every other algorithm (rotation, float targets, tuning, head refit) is switched on by its own options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.methods import registry
from quantkit.quantization.methods.registry import Algorithm, Role

DEFAULT_METHOD = "gptq"
IMPLIED_SOLVER = "rtn"  # data-free: what a method naming only transforms rounds with
METHOD_ROLES = (Role.TRANSFORM, Role.SOLVER)  # the roles a method spelling names
# scheme options before any algorithm's defaults (see Capabilities.scheme_defaults)
BASE_SCHEME_DEFAULTS = {"symmetric": True, "act_order": False, "static_groups": True, "mse_clip": False}


@dataclass(frozen=True)
class Step:
    """One algorithm of a job, with its config."""

    algorithm: Algorithm
    config: Any

    @property
    def name(self) -> str:
        return self.algorithm.name

    @property
    def hooks(self) -> Any:
        return self.algorithm.hooks


class JobSteps:
    """A job's algorithms: inactive configs dropped (tuning with 0 steps), checked, in role order."""

    def __init__(self, configs: Sequence[Any]) -> None:
        steps = [Step(registry.of(config), config) for config in configs]
        active = [s for s in steps if s.algorithm.switch.is_on(s.config)]
        self.steps: tuple[Step, ...] = tuple(sorted(active, key=lambda s: s.algorithm.role))
        _check(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def with_role(self, role: Role) -> list[Step]:
        return [s for s in self.steps if s.algorithm.role == role]

    def get(self, name: str) -> Step | None:
        return next((s for s in self.steps if s.name == name), None)

    @property
    def solver(self) -> Step:
        return self.with_role(Role.SOLVER)[0]

    @property
    def method(self) -> str:
        """The spelling of the transforms and the solver (``awq+gptq``; ``awq`` when the solver is implied)."""
        return spelling(self.steps)

    def any_cap(self, cap: str) -> bool:
        return any(getattr(s.algorithm.caps, cap) for s in self.steps)

    @property
    def needs_calibration(self) -> bool:
        return self.any_cap("needs_calibration")

    @property
    def keeps_float_path(self) -> bool:
        """The run carries the float model's activations beside the quantized ones."""
        return self.any_cap("needs_float_path")

    def canonical(self) -> list[dict[str, Any]]:
        """Every step with every option, in run order: what the fingerprint hashes and the run log records."""
        return [{"name": s.name, **dataclasses.asdict(s.config)} for s in self.steps]

    def scheme_defaults(self) -> dict[str, bool]:
        """The scheme options this job's method defaults to: the solver's, then the transforms' (which win)."""
        defaults = dict(BASE_SCHEME_DEFAULTS)
        for step in self.with_role(Role.SOLVER) + self.with_role(Role.TRANSFORM):
            defaults.update(step.algorithm.caps.scheme_defaults)
        return defaults


def _check(steps: tuple[Step, ...]) -> None:
    names = [s.name for s in steps]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise QuantkitError(f"{', '.join(twice)} appears more than once in the job; keep one")
    solvers = [s.name for s in steps if s.algorithm.role == Role.SOLVER]
    if len(solvers) != 1:
        have = ", ".join(solvers) or "none"
        raise QuantkitError(f"a job needs exactly one weight solver ({', '.join(solver_names())}); it has {have}")
    for step in steps:
        missing = [r for r in step.algorithm.caps.requires if r not in names]
        if missing:
            method = spelling(steps)
            with_it = ", ".join(m for m in method_spellings() if all(r in m.split("+") for r in missing))
            label = step.algorithm.summary.split(":")[0]
            raise QuantkitError(
                f"{label} work only with {' and '.join(missing)}: method '{method}' has no {' or '.join(missing)} "
                f"step; use {with_it}"
            )


def spelling(steps: Sequence[Step]) -> str:
    """The method spelling of a job's transforms and solver (the implied solver left out after a transform)."""
    named = [s.name for s in steps if s.algorithm.role in METHOD_ROLES]
    if len(named) > 1 and named[-1] == IMPLIED_SOLVER:
        named.pop()
    return "+".join(named)


def solver_names() -> list[str]:
    return [a.name for a in registry.algorithms() if a.role == Role.SOLVER]


def method_spellings() -> list[str]:
    """Every method spelling: each solver alone, then each transform alone and before each explicit solver."""
    solvers = solver_names()
    transforms = [a.name for a in registry.algorithms() if a.role == Role.TRANSFORM]
    spellings = list(solvers)
    for transform in transforms:
        spellings += [transform, *(f"{transform}+{s}" for s in solvers if s != IMPLIED_SOLVER)]
    return spellings


def parse_method(method: str) -> list[Any]:
    """The default configs of a method spelling's algorithms (``awq+gptq``: AWQ's, then GPTQ's)."""
    if method not in method_spellings():
        raise QuantkitError(f"unknown method '{method}'; use one of {', '.join(method_spellings())}")
    names = method.split("+")
    if not any(registry.by_name(n).role == Role.SOLVER for n in names):
        names.append(IMPLIED_SOLVER)
    return [registry.by_name(n).config() for n in names]


def with_method(method: str, *overrides: Any) -> list[Any]:
    """A method's configs with ``overrides`` replacing its own (same type) and adding the others (tuning...)."""
    configs = parse_method(method)
    given = {type(c): c for c in overrides}
    unused = [c for c in overrides if registry.of(c).role in METHOD_ROLES and type(c) not in map(type, configs)]
    if unused:
        steps = "+".join(registry.of(c).name for c in configs)
        raise QuantkitError(f"method '{method}' has no {registry.of(unused[0]).name} step; its steps are {steps}")
    return [given.pop(type(c), c) for c in configs] + list(given.values())


def resolve_scheme(
    defaults: dict[str, bool],
    base: QuantScheme | None = None,
    *,
    bits: int | None = None,
    group_size: int | None = None,
    symmetric: bool | None = None,
    act_order: bool | None = None,
    static_groups: bool | None = None,
    mse_clip: bool | None = None,
) -> QuantScheme:
    """The scheme a job quantizes with: each option given wins, then ``base``'s layout (a preset's bits, group,
    symmetry, element type, scale format, blocks and input scheme), then the method's ``defaults``; bits and group
    size last fall back to QuantScheme's."""
    if base is None:
        base = QuantScheme(symmetric=defaults["symmetric"])
    return dataclasses.replace(
        base,
        bits=_first(bits, base.bits),
        group_size=_first(group_size, base.group_size),
        symmetric=_first(symmetric, base.symmetric),
        act_order=_first(act_order, defaults["act_order"]),
        static_groups=_first(static_groups, defaults["static_groups"]),
        mse_clip=_first(mse_clip, defaults["mse_clip"]),
    )


def method_scheme(method: str, **fields: Any) -> QuantScheme:
    """The scheme a method spelling quantizes with: ``fields`` given (bits, group_size, ...), the rest its defaults."""
    return resolve_scheme(JobSteps(parse_method(method)).scheme_defaults(), **fields)


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def with_solver_options(scheme: QuantScheme, options: QuantScheme) -> QuantScheme:
    """``scheme``'s storage layout (bits, groups, symmetry) solved with ``options``' solver settings.

    Used to apply one run's act-order / MSE-clip choice to every scheme of a mixed-precision plan. Dynamic
    act-order groups would add a g_idx per linear that the plan's bit budget did not count, so they are refused.
    """
    if options.act_order and not options.static_groups:
        raise QuantkitError(
            "act-order without static groups records a g_idx per linear that the plan's bit budget does not "
            "count; use --static-groups (the default) or --no-act-order with a plan"
        )
    return dataclasses.replace(
        scheme, act_order=options.act_order, static_groups=options.static_groups, mse_clip=options.mse_clip
    )
