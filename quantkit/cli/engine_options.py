"""Command-line options derived in one place from config dataclasses' fields: the engine options of ``quantkit serve``
and ``quantkit bench`` (EngineConfig), and the server options of ``quantkit serve`` (ServeConfig).

``@engine_options`` turns a command's EngineConfig parameter into one option per field: ``--<field
name>`` with the field's default and the help in its metadata (:mod:`quantkit.runtime.config`), and calls the
command with the EngineConfig they make. A new EngineConfig field is therefore a new option of both commands.
``@serve_options`` does the same for a ServeConfig parameter (:mod:`quantkit.server.config`; its ``engine`` field
is left to ``@engine_options``, and a field's ``envvar`` metadata is read from the environment too).
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
_SERVE_SKIPPED = ("engine",)  # ServeConfig fields that are no options of their own


def engine_options(command: Callable[..., Any] | None = None, *, help: dict[str, str] | None = None) -> Any:
    """Decorate a command with one parameter annotated EngineConfig; ``help`` replaces a field's help for it."""
    if command is None:
        return functools.partial(engine_options, help=help)
    return _derive(command, EngineConfig, help or {}, HIDDEN_ALIASES, ())


def serve_options(command: Callable[..., Any]) -> Any:
    """Decorate a command with one parameter annotated ServeConfig (built without its engine: the command passes
    ``dataclasses.replace(config, engine=...)`` or sets it)."""
    from quantkit.server.config import ServeConfig

    return _derive(command, ServeConfig, {}, {}, _SERVE_SKIPPED)


def _derive(
    command: Callable[..., Any], cls: type, help: dict[str, str], aliases: dict[str, str], skip: tuple[str, ...]
) -> Any:
    own = inspect.signature(command, eval_str=True).parameters
    [target] = [name for name, p in own.items() if p.annotation is cls]
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    clash = {f.name for f in fields} & set(own)
    assert not clash, f"{command.__name__}'s parameters {sorted(clash)} shadow {cls.__name__} fields"
    options = [_option(cls, f, help.get(f.name)) for f in fields]
    hidden = [_alias(cls, alias, field) for alias, field in aliases.items()]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        values = {f.name: kwargs.pop(f.name) for f in fields}
        for alias, field in aliases.items():
            value = kwargs.pop(alias)
            if value is not None:
                if values[field] is not None:
                    raise QuantkitError(f"--{_flag(alias)} is the old name of --{_flag(field)}; give only one")
                values[field] = value
        return command(**kwargs, **{target: cls(**values)})

    parameters = [p for name, p in own.items() if name != target] + options + hidden
    wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper


def _option(cls: type, field: dataclasses.Field[Any], help: str | None) -> inspect.Parameter:
    annotation = typing.get_type_hints(cls)[field.name]
    text = help if help is not None else field.metadata.get("help", "")
    extra = {"envvar": field.metadata["envvar"]} if "envvar" in field.metadata else {}
    return inspect.Parameter(
        field.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=field.default,
        annotation=Annotated[annotation, typer.Option(help=text, **extra)],
    )


def _alias(cls: type, alias: str, field: str) -> inspect.Parameter:
    annotation = typing.get_type_hints(cls)[field]
    return inspect.Parameter(
        alias, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[annotation, typer.Option(hidden=True)]
    )


def _flag(name: str) -> str:
    return name.replace("_", "-")
