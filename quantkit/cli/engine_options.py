"""The engine options of ``quantkit serve`` and ``quantkit bench``, derived in one place from EngineConfig's fields.

``@engine_options`` turns a command's EngineConfig parameter into one option per field: ``--<field
name>`` with the field's default and the help in its metadata (:mod:`quantkit.runtime.config`), and calls the
command with the EngineConfig they make. A new EngineConfig field is therefore a new option of both commands.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig

# Old spellings kept working (hidden from --help): option -> the field it sets.
HIDDEN_ALIASES = {"kv_cache_blocks": "num_kv_blocks"}  # `serve --kv-cache-blocks` before the options were derived


def engine_options(command: Callable[..., Any] | None = None, *, help: dict[str, str] | None = None) -> Any:
    """Decorate a command with one parameter annotated EngineConfig; ``help`` replaces a field's help for it."""
    if command is None:
        return functools.partial(engine_options, help=help)
    own = inspect.signature(command, eval_str=True).parameters
    [target] = [name for name, p in own.items() if p.annotation is EngineConfig]
    fields = dataclasses.fields(EngineConfig)
    clash = {f.name for f in fields} & set(own)
    assert not clash, f"{command.__name__}'s parameters {sorted(clash)} shadow EngineConfig fields"
    options = [_option(f, (help or {}).get(f.name)) for f in fields]
    aliases = [_alias(alias, field) for alias, field in HIDDEN_ALIASES.items()]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        values = {f.name: kwargs.pop(f.name) for f in fields}
        for alias, field in HIDDEN_ALIASES.items():
            value = kwargs.pop(alias)
            if value is not None:
                if values[field] is not None:
                    raise QuantkitError(f"--{_flag(alias)} is the old name of --{_flag(field)}; give only one")
                values[field] = value
        return command(**kwargs, **{target: EngineConfig(**values)})

    parameters = [p for name, p in own.items() if name != target] + options + aliases
    wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper


def _option(field: dataclasses.Field[Any], help: str | None) -> inspect.Parameter:
    annotation = typing.get_type_hints(EngineConfig)[field.name]
    text = help if help is not None else field.metadata.get("help", "")
    return inspect.Parameter(
        field.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=field.default,
        annotation=Annotated[annotation, typer.Option(help=text)],
    )


def _alias(alias: str, field: str) -> inspect.Parameter:
    annotation = typing.get_type_hints(EngineConfig)[field]
    return inspect.Parameter(
        alias, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[annotation, typer.Option(hidden=True)]
    )


def _flag(name: str) -> str:
    return name.replace("_", "-")
