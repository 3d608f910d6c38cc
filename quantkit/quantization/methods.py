"""Quantization methods: the spellings users type, the solver lists they stand for, and their default schemes.

A method is a list of solver configs run in order on each decoder block: zero or more transforms of the float
block (AWQ's scales and clipping), then one weight solver (round-to-nearest or GPTQ). ``awq+gptq`` is the
spelling of ``[AWQConfig(), GPTQConfig()]``. Each solver config's own defaults are quantkit's defaults; the
per-method defaults of the scheme (symmetry, act-order, MSE clipping) are decided here, once, for the CLI, the
recipes and the Python API alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.solvers.awq import AWQConfig
from quantkit.quantization.solvers.gptq import GPTQConfig
from quantkit.quantization.solvers.grid import RTNConfig

SolverConfig = RTNConfig | GPTQConfig | AWQConfig
TRANSFORMS: tuple[type, ...] = (AWQConfig,)  # rewrite the float block before its weights are quantized
WEIGHT_SOLVERS: tuple[type, ...] = (RTNConfig, GPTQConfig)  # turn a block's weights into integers
SOLVER_NAMES: dict[type, str] = {RTNConfig: "rtn", GPTQConfig: "gptq", AWQConfig: "awq"}
METHODS: dict[str, tuple[type, ...]] = {
    "rtn": (RTNConfig,),
    "gptq": (GPTQConfig,),
    "awq": (AWQConfig, RTNConfig),  # AWQ's scales and clipping, then round-to-nearest (as AutoAWQ)
    "awq+gptq": (AWQConfig, GPTQConfig),
}


def expand_method(method: str, *overrides: SolverConfig) -> list[SolverConfig]:
    """The solver configs a method spelling stands for; a config in ``overrides`` replaces the default one."""
    kinds = METHODS.get(method)
    if kinds is None:
        raise QuantkitError(f"unknown method '{method}'; use one of {', '.join(METHODS)}")
    given = {type(config): config for config in overrides}
    unused = set(given) - set(kinds)
    if unused:
        names = ", ".join(sorted(SOLVER_NAMES[k] for k in unused))
        raise QuantkitError(f"method '{method}' has no {names} step; its steps are {method_name_of(kinds)}")
    return [given.get(kind) or kind() for kind in kinds]


def method_name_of(kinds: Sequence[type]) -> str:
    return "+".join(SOLVER_NAMES[k] for k in kinds if k is not RTNConfig or len(kinds) == 1)


def method_name(solvers: Sequence[SolverConfig]) -> str:
    """The spelling of a solver list (``[AWQConfig(), GPTQConfig()]`` -> ``awq+gptq``); checks its shape."""
    check_solvers(solvers)
    return method_name_of([type(s) for s in solvers])


def check_solvers(solvers: Sequence[SolverConfig]) -> None:
    """Transforms first, then exactly one weight solver, as one of the known methods."""
    kinds = tuple(type(s) for s in solvers)
    if kinds not in METHODS.values():
        shown = ", ".join(type(s).__name__ for s in solvers) or "nothing"
        spellings = ", ".join(f"{name} = [{', '.join(k.__name__ for k in ks)}]" for name, ks in METHODS.items())
        raise QuantkitError(f"cannot quantize with [{shown}]; use one of: {spellings}")


def check_float_targets(method: str, float_targets: bool) -> None:
    """Float targets change what GPTQ fits; a method without a GPTQ step has nothing to apply them to."""
    if float_targets and GPTQConfig not in METHODS.get(method, ()):
        with_gptq = ", ".join(name for name, kinds in METHODS.items() if GPTQConfig in kinds)
        raise QuantkitError(f"float targets are a GPTQ option and method '{method}' has no GPTQ step; use {with_gptq}")


def needs_calibration(solvers: Sequence[SolverConfig]) -> bool:
    """Round-to-nearest alone needs no activations: no calibration, no forward passes."""
    return any(not isinstance(s, RTNConfig) for s in solvers)


@dataclass(frozen=True)
class MethodDefaults:
    """What a method uses unless told otherwise.

    Measured on SmolLM2-135M W4 g64 sym, 128 x 512 calibration, held-out perplexity (original 44.39, RTN 58.21):
    plain GPTQ 55.43, act-order with static groups 51.05, plus Hessian-weighted MSE clipping 47.58 (77% of RTN's
    gap closed). Unweighted MSE clipping does not help RTN (59.62), so it is on for GPTQ only; after AWQ's own
    clipping it is off. AWQ is asymmetric, as in AutoAWQ.
    """

    symmetric: bool
    act_order: bool
    static_groups: bool
    mse_clip: bool


def method_defaults(method: str) -> MethodDefaults:
    kinds = [type(s) for s in expand_method(method)]
    awq, gptq = AWQConfig in kinds, GPTQConfig in kinds
    return MethodDefaults(symmetric=not awq, act_order=gptq, static_groups=True, mse_clip=gptq and not awq)


def resolve_scheme(
    method: str,
    *,
    bits: int = QuantScheme.bits,
    group_size: int = QuantScheme.group_size,
    symmetric: bool | None = None,
    act_order: bool | None = None,
    static_groups: bool | None = None,
    mse_clip: bool | None = None,
) -> QuantScheme:
    """The scheme a method quantizes with: each option left as None takes the method's default."""
    defaults = method_defaults(method)

    def pick(value: bool | None, default: bool) -> bool:
        return default if value is None else value

    return QuantScheme(
        bits=bits,
        group_size=group_size,
        symmetric=pick(symmetric, defaults.symmetric),
        act_order=pick(act_order, defaults.act_order),
        static_groups=pick(static_groups, defaults.static_groups),
        mse_clip=pick(mse_clip, defaults.mse_clip),
    )


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
