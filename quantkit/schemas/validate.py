"""Validate a located tree against a pydantic model; the first problem becomes one ``QuantkitError``.

The message reads ``file:line: key.path: problem[; fix]``, e.g. ``recipe.yaml:8: quantization.scheme.bits:
expected one of 2, 3, 4, 8, got 5``. Keys of a model are joined with dots, keys of a mapping and list indices
are bracketed (``units[3].options['int4-g64'].bits``); ``item_labels`` names list items by a format of their
keys (``{"units": "{name}"}`` gives ``units[3] (model.layers.0.mlp.down_proj)``). Unknown keys and bad choices
get the closest valid name ("did you mean"), else the list of valid ones. An unknown key is reported before
other problems (it is likely a typo of a missing key), then problems in file order.
"""

from __future__ import annotations

import difflib
import math
import types
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from quantkit.errors import QuantkitError
from quantkit.schemas.located import format_where, locate

M = TypeVar("M", bound=BaseModel)
_RULE = "quantkit_rule"
_KEY = "[key]"  # pydantic's last location part for an invalid mapping key
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", Any: "any value"}
_PLURALS = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}


def rule_error(message: str, *at: str | int) -> PydanticCustomError:
    """An error for a model validator; ``at`` is the key path, below the validated model, that it is about."""
    return PydanticCustomError(_RULE, "{message}", {"message": message, "at": at})


def validate(
    model: type[M],
    data: Any,
    label: str,
    *,
    error: type[QuantkitError] = QuantkitError,
    fix: str = "",
    item_labels: Mapping[str, str] | None = None,
) -> M:
    """``data`` validated as ``model``; raises ``error`` naming the first problem (see the module docstring)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(describe(exc, model, data, label, fix=fix, item_labels=item_labels)) from exc


def error_at(
    label: str, data: Any, path: Iterable[Any], message: str, *, error: type[QuantkitError] = QuantkitError
) -> QuantkitError:
    """``error`` with ``message`` placed at the location of ``path`` in ``data`` (for checks after validation)."""
    return error(f"{format_where(label, locate(data, path))}: {message}")


def describe(
    exc: ValidationError,
    model: type[BaseModel],
    data: Any,
    label: str,
    *,
    fix: str = "",
    item_labels: Mapping[str, str] | None = None,
) -> str:
    """The message for the first problem in ``exc``: ``label:line: path: problem[; fix]``."""

    def order(item: tuple[int, ErrorDetails]) -> tuple[bool, float, int]:
        index, err = item
        where = locate(data, _path(err))
        return err["type"] != "extra_forbidden", where if isinstance(where, int) else math.inf, index

    _, err = min(enumerate(exc.errors(include_url=False)), key=order)
    path = _path(err)
    kinds = _types_along(model, path)
    text = format_path(path, kinds, data, item_labels or {})
    message = f"{format_where(label, locate(data, path))}: " + (f"{text}: " if text else "")
    return message + _problem(err, path, kinds) + (f"; {fix}" if fix else "")


def _path(err: ErrorDetails) -> tuple[Any, ...]:
    at = (err.get("ctx") or {}).get("at", ()) if err["type"] == _RULE else ()
    return (*err["loc"], *at)


# --------------------------------------------------------------------------------------------------
# The annotation at each step of a path
# --------------------------------------------------------------------------------------------------


def _strip(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and without ``| None``."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType) and type(None) in get_args(tp):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _types_along(model: type[BaseModel], path: tuple[Any, ...]) -> list[Any]:
    """The annotation at each prefix of ``path`` (None where unknown): ``[model, at path[:1], ...]``."""
    kinds: list[Any] = [model]
    for part in path:
        parent = _strip(kinds[-1])
        args = get_args(parent)
        if part == _KEY:
            grand = _strip(kinds[-2]) if len(kinds) > 1 else None
            kinds.append(get_args(grand)[0] if get_origin(grand) is dict else None)
        elif _is_model(parent):
            field = parent.model_fields.get(part) if isinstance(part, str) else None
            kinds.append(field.annotation if field else None)
        elif get_origin(parent) is list and args:
            kinds.append(args[0])
        elif get_origin(parent) is dict and len(args) == 2:
            kinds.append(args[1])
        else:
            kinds.append(None)
    return kinds


def format_path(path: tuple[Any, ...], kinds: list[Any], data: Any, item_labels: Mapping[str, str]) -> str:
    """``a.b[3] (label).c['key']``: model keys dotted, list indices and mapping keys bracketed."""
    text, node = "", data
    for i, part in enumerate(path):
        parent = _strip(kinds[i])
        if part == _KEY:
            return f"{text} (key)"
        if isinstance(part, int) and get_origin(parent) is not dict:
            text += f"[{part}]" + _item_label(node, part, item_labels.get(path[i - 1]) if i else None)
        elif _is_model(parent) or (parent is None and isinstance(part, str)):
            text += f".{part}" if text else str(part)
        else:
            text += f"[{part!r}]"
        node = _child(node, part)
    return text


def _child(node: Any, part: Any) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def _item_label(node: Any, index: int, fmt: str | None) -> str:
    item = _child(node, index)
    if fmt is None or not isinstance(item, dict):
        return ""
    try:
        return f" ({fmt.format_map(item)})"
    except (KeyError, ValueError, TypeError, AttributeError, IndexError):
        return ""


# --------------------------------------------------------------------------------------------------
# What was expected, what was found
# --------------------------------------------------------------------------------------------------


def expected(tp: Any) -> str:
    """What ``tp`` accepts, in words: ``an integer``, ``a list of strings (or null)``, ``one of a, b``."""
    stripped = _strip(tp)
    origin, args = get_origin(stripped), get_args(stripped)
    if origin is Literal:
        text = "one of " + ", ".join(map(str, args))
    elif _is_model(stripped):
        text = f"a mapping with keys {', '.join(stripped.model_fields)}"
    elif origin is list:
        text = f"a list of {_plural(args[0])}" if args else "a list"
    elif origin is dict:
        text = f"a mapping of {_plural(args[0])} to {_plural(args[1])}" if args and args[1] is not Any else "a mapping"
    else:
        text = _NAMES.get(stripped, "a valid value")
    nullable = stripped is not tp and type(None) in get_args(tp)
    return text + (" (or null)" if nullable else "")


def _plural(tp: Any) -> str:
    tp = _strip(tp)
    if _is_model(tp):
        return f"mappings with keys {', '.join(tp.model_fields)}"
    return _PLURALS.get(tp, "values")


def shown(value: Any) -> str:
    """A found value, in words: ``a mapping``, ``null``, ``str 'many'``."""
    if isinstance(value, dict):
        return "a mapping" if value else "an empty mapping"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _suggest(word: str, choices: list[str]) -> str | None:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def _problem(err: ErrorDetails, path: tuple[Any, ...], kinds: list[Any]) -> str:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    tp = _strip(kinds[-1])
    if kind == _RULE:
        return str(ctx["message"])
    if kind == "value_error":
        return str(ctx["error"])
    if kind == "extra_forbidden":
        parent = _strip(kinds[-2])
        keys = list(parent.model_fields) if _is_model(parent) else []
        close = _suggest(str(path[-1]), keys)
        hint = f"did you mean '{close}'?" if close else f"valid keys here: {', '.join(keys)}"
        return f"unknown key '{path[-1]}'; {hint}"
    if kind == "missing":
        where = format_path(path[:-1], kinds, None, {}) or "the top level"
        return f"missing required key '{path[-1]}' in {where}"
    if kind == "literal_error":
        choices = [str(c) for c in get_args(tp)] if get_origin(tp) is Literal else [str(ctx.get("expected"))]
        close = _suggest(str(value), choices)
        hint = f"; did you mean '{close}'?" if close else ""
        return f"expected one of {', '.join(choices)}, got {value!r}{hint}"
    if kind in _BOUNDS:
        bound = next(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le"))
        return f"expected a value {_BOUNDS[kind]} {bound:g}, got {value!r}"
    if kind == "too_short":
        count = "one item" if ctx.get("min_length") == 1 else f"{ctx.get('min_length')} items"
        return f"expected at least {count}, got {shown(value)}"
    if kind == "string_too_short":
        return f"expected a non-empty string, got {value!r}"
    if kind == "finite_number":
        return f"expected a finite number, got {value!r}"
    if kind.endswith("_type"):
        quote = " (quote it)" if tp is str and isinstance(value, (int, float, bool)) else ""
        return f"expected {expected(kinds[-1])}, got {shown(value)}{quote}"
    return f"{err['msg'][:1].lower()}{err['msg'][1:]}, got {shown(value)}"
