"""The job's options as flat ``--flags``, derived from the typed configs: the method, the scheme, every registered
algorithm's fields (their ``option`` metadata) and the job's own fields. The CLI turns :func:`job_options` into
its parameters and :func:`config_from_options` turns the values back into a :class:`QuantizeConfig`; the
benchmarks spell their rows with :func:`options_to_args`. A new algorithm's options appear here without an edit.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from quantkit.format.presets import PRESETS, preset
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods import registry
from quantkit.quantization.methods.composition import (
    DEFAULT_METHOD,
    JobSteps,
    method_spellings,
    parse_method,
    resolve_scheme,
)
from quantkit.quantization.methods.registry import Algorithm

SCHEME, SOLVERS, RUN = "Scheme", "Solvers", "Run"  # help panels


@dataclass(frozen=True)
class JobOption:
    param: str  # the Python name of the value (also its key in the values mapping)
    flags: tuple[str, ...]  # e.g. ("--damp",), ("--sym/--asym",)
    type: Any  # the value's type (``X | None``: not given unless the user gives it)
    default: Any
    help: str
    panel: str
    target: tuple[
        str, ...
    ]  # ("method",), ("scheme", field), ("algorithm", name, field), ("switch", name), ("job", field)


def _flag(param: str) -> str:
    return "--" + param.replace("_", "-")


def _method_option() -> JobOption:
    return JobOption(
        "method", ("--method",), str, DEFAULT_METHOD, f"{', '.join(method_spellings())}.", SOLVERS, ("method",)
    )


def _scheme_help(field: str, what: str, on: str = "on", off: str = "off") -> str:
    """``what`` plus the default per method (from the registry's scheme defaults)."""
    methods = method_spellings()
    yes = [m for m in methods if JobSteps(parse_method(m)).scheme_defaults()[field]]
    no = [m for m in methods if m not in yes]
    if not no or not yes:
        return f"{what} (default: {on if yes else off})."
    return f"{what} (default: {on} for {', '.join(yes)}; {off} for {', '.join(no)})."


def _scheme_options() -> list[JobOption]:
    presets = ", ".join(PRESETS)
    return [
        JobOption("scheme", ("--scheme",), str | None, None, f"A preset as compressed-tensors names it: {presets}; "
                  "--bits/--group-size/--sym/--asym given beside it win.", SCHEME, ("preset",)),
        JobOption("bits", ("--bits",), int | None, None, f"Weight bits: 2, 3, 4 or 8 (default: {QuantScheme.bits}).",
                  SCHEME, ("scheme", "bits")),
        JobOption("group_size", ("--group-size",), int | None, None, "Columns per scale group; -1 for per-channel "
                  f"(default: {QuantScheme.group_size}).", SCHEME, ("scheme", "group_size")),
        JobOption("sym", ("--sym/--asym",), bool | None, None, _scheme_help("symmetric", "Symmetric, or asymmetric "
                  "with a zero point per group", "sym", "asym"), SCHEME, ("scheme", "symmetric")),
        JobOption("act_order", ("--act-order/--no-act-order",), bool | None, None,
                  _scheme_help("act_order", "GPTQ: columns by descending Hessian diagonal"), SCHEME,
                  ("scheme", "act_order")),
        JobOption("static_groups", ("--static-groups/--no-static-groups",), bool | None, None,
                  _scheme_help("static_groups", "With --act-order: groups fixed in column order (no g_idx)"), SCHEME,
                  ("scheme", "static_groups")),
        JobOption("mse_clip", ("--mse-clip/--no-mse-clip",), bool | None, None,
                  _scheme_help("mse_clip", "Search a shrunken range per group, weighted by the Hessian"), SCHEME,
                  ("scheme", "mse_clip")),
    ]  # fmt: skip


def _algorithm_options(algorithm: Algorithm) -> list[JobOption]:
    options = []
    switch = algorithm.switch
    if switch.kind == "flag":
        param = switch.flag.removeprefix("--").replace("-", "_")
        options.append(JobOption(param, (switch.flag,), bool, False, switch.help, SOLVERS, ("switch", algorithm.name)))
    hints = typing.get_type_hints(algorithm.config)
    for field in dataclasses.fields(algorithm.config):
        if not field.metadata.get("cli"):
            continue
        flag = field.metadata["flag"] or _flag(f"{algorithm.name}_{field.name}")
        default = switch.off if switch.kind == "field" and field.name == switch.field else field.default
        param = flag.removeprefix("--").replace("-", "_")
        target = ("algorithm", algorithm.name, field.name)
        tp = (
            str if typing.get_origin(hints[field.name]) is typing.Literal else hints[field.name]
        )  # checked by the config
        options.append(JobOption(param, (flag,), tp, default, field.metadata["help"], SOLVERS, target))
    return options


def _job_field_options() -> list[JobOption]:
    hints = typing.get_type_hints(QuantizeConfig)
    options = []
    for field in dataclasses.fields(QuantizeConfig):
        if field.metadata.get("cli"):
            flag = field.metadata["flag"] or _flag(field.name)
            default = field.default if field.default is not dataclasses.MISSING else None
            tp = hints[field.name]
            if typing.get_origin(tp) is list:
                tp = tp | None  # a repeatable option: None when not given
            options.append(
                JobOption(field.name, (flag,), tp, default, field.metadata["help"], RUN, ("job", field.name))
            )
    return options


def job_options() -> list[JobOption]:
    """Every flat option of a quantization job, in help order."""
    options = [*_scheme_options(), _method_option()]
    for algorithm in registry.algorithms():
        options += _algorithm_options(algorithm)
    return options + _job_field_options()


def config_from_options(values: dict[str, Any], **fields: Any) -> QuantizeConfig:
    """The job config of flat option values (missing ones take their defaults); ``fields`` set the rest
    (calibration, calibration_file, export_formats, planned, show_progress...).

    Every algorithm's options are checked, whether or not the job holds it (``--damp 2`` fails with rtn too); an
    algorithm switched on by its flag or field joins the method's.
    """
    options = job_options()
    given = {o.param: values.get(o.param, o.default) for o in options}
    method_configs = parse_method(given["method"])
    in_method = {registry.of(c).name for c in method_configs}
    solvers: list[Any] = []
    for algorithm in registry.algorithms():
        kwargs = {o.target[2]: given[o.param] for o in options if o.target[:2] == ("algorithm", algorithm.name)}
        config = algorithm.config(**kwargs)
        switch = algorithm.switch
        if switch.kind == "method":
            if algorithm.name in in_method:
                solvers.append(config)
        elif switch.kind == "flag":
            if any(given[o.param] for o in options if o.target == ("switch", algorithm.name)):
                solvers.append(config)
        elif switch.is_on(config):
            solvers.append(config)
    steps = JobSteps(solvers)
    scheme_fields = {o.target[1]: given[o.param] for o in options if o.target[0] == "scheme"}
    base = None if given["scheme"] is None else preset(given["scheme"])
    scheme = resolve_scheme(steps.scheme_defaults(), base, **scheme_fields)
    job_fields = {o.target[1]: given[o.param] for o in options if o.target[0] == "job"}
    job_fields["ignore"] = list(job_fields.get("ignore") or [])
    return QuantizeConfig(solvers=solvers, scheme=scheme, **job_fields, **fields)


def options_to_args(values: dict[str, Any]) -> list[str]:
    """Command-line arguments that set ``values`` (param -> value), for running ``quantkit quantize``."""
    by_param = {o.param: o for o in job_options()}
    args: list[str] = []
    for param, value in values.items():
        option = by_param[param]
        flag = option.flags[0]
        if option.type in (bool, bool | None):
            on, _, off = flag.partition("/")
            args.append(on if value else (off or "--no-" + on.removeprefix("--")))
        elif isinstance(value, list):
            for item in value:
                args += [flag, str(item)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def options_markdown() -> str:
    """The job's options as a markdown table (docs/cli.md carries it; a test checks the page against this)."""
    lines = ["| option | default | what it sets |", "|---|---|---|"]
    for option in job_options():
        default = "-" if option.default is None else f"`{option.default}`"
        lines.append(f"| `{' / '.join(option.flags)}` | {default} | {option.help} |")
    return "\n".join(lines)
