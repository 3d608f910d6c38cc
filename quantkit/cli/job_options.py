"""The quantization job's options on a Typer command: the parameters come from
:func:`quantkit.quantization.options.job_options` (derived from the typed configs), so a new algorithm or option
shows up in ``quantize --help`` without an edit here."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from quantkit.quantization.options import JobOption, job_options

JOB_VALUES = "job_values"  # the parameter of the decorated command that receives the options' values


def _parameter(option: JobOption) -> inspect.Parameter:
    info = typer.Option(*option.flags, help=option.help, rich_help_panel=option.panel, show_default=True)
    return inspect.Parameter(
        option.param,
        inspect.Parameter.KEYWORD_ONLY,
        default=option.default,
        annotation=Annotated[option.type, info],
    )


def with_job_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with every job option added to its parameters; their values reach it as one mapping in its
    ``job_values`` parameter (param -> value)."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for name, p in signature.parameters.items() if name != JOB_VALUES]
    options = job_options()
    names = {o.param for o in options}
    clash = names & {p.name for p in own}
    assert not clash, f"{command.__name__} already has parameters {clash}"

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in names}
        return command(**kwargs, **{JOB_VALUES: values})

    keyword_only = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]  # typer passes every one by name
    parameters = [*keyword_only, *map(_parameter, options)]
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return wrapper
