"""YAML and JSON loaded into plain dicts and lists that remember where each key and item came from.

A location (:data:`Where`) is a 1-based line number, or a note for a value that did not come from the file
(``"--set a.b=c"``). :func:`locate` finds the location of a key path such as ``("units", 3, "options")``;
:func:`format_where` spells it ``file:12`` or ``file (--set a.b=c)``. A duplicate key is an error in both
formats. JSON values come from :mod:`json` (PyYAML's YAML 1.1 resolver would read ``1e-05`` as a string); only
the positions come from composing the same text as YAML, and a text PyYAML cannot compose loads without them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import yaml

from quantkit.errors import QuantkitError

Where = int | str
OnString = Callable[[str, int, bool], Any]  # (text, line, quoted) -> the value of a YAML string scalar


class LocatedDict(dict):
    """A mapping that remembers its own location (``where``) and each key's (``key_where``)."""

    def __init__(self, items: Iterable[tuple[Any, Any]] = (), where: Where | None = None) -> None:
        super().__init__(items)
        self.where = where
        self.key_where: dict[Any, Where] = {}

    def where_of(self, key: Any) -> Where | None:
        """The location of ``key``; None when unknown."""
        return self.key_where.get(key)


class LocatedList(list):
    """A list that remembers its own location (``where``) and each item's (``item_where``)."""

    def __init__(
        self, items: Iterable[Any] = (), where: Where | None = None, item_where: Iterable[Where | None] = ()
    ) -> None:
        super().__init__(items)
        self.where = where
        self.item_where: list[Where | None] = list(item_where)

    def where_of(self, index: int) -> Where | None:
        """The location of item ``index``; None when unknown."""
        return self.item_where[index] if 0 <= index < len(self.item_where) else None


def format_where(label: str, where: Where | None) -> str:
    """``label:12`` for a line, ``label (--set a.b=c)`` for a note, ``label`` when the location is unknown."""
    if isinstance(where, int):
        return f"{label}:{where}"
    return f"{label} ({where})" if where else label


def locate(data: Any, path: Iterable[Any]) -> Where | None:
    """The location of the deepest part of ``path`` present in ``data`` (a key missing there: its mapping's)."""
    where = getattr(data, "where", None)
    node = data
    for part in path:
        if isinstance(node, dict) and isinstance(part, Hashable) and part in node:
            child_where = node.where_of(part) if isinstance(node, LocatedDict) else None
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            child_where = node.where_of(part) if isinstance(node, LocatedList) else None
        else:
            break
        node = node[part]
        where = child_where if child_where is not None else where
    return where


def located(value: Any, where: Where) -> Any:
    """``value`` with its dicts and lists made located, every key and item at ``where``."""
    if isinstance(value, dict):
        out = LocatedDict(((k, located(v, where)) for k, v in value.items()), where)
        out.key_where = dict.fromkeys(out, where)
        return out
    if isinstance(value, list):
        return LocatedList((located(v, where) for v in value), where, [where] * len(value))
    return value


def plain(value: Any) -> Any:
    """``value`` with located dicts and lists turned back into plain ones (``yaml.safe_dump`` wants those)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    label = "file"
    error: type[QuantkitError] = QuantkitError
    on_string: OnString | None = None


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LocatedDict:
    loader.flatten_mapping(node)
    result = LocatedDict(where=_line(node))
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, "found an unhashable key", key_node.start_mark
            )
        if key in result:
            raise loader.error(f"{loader.label}:{_line(key_node)}: duplicate key '{key}'; keep one")
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_where[key] = _line(key_node)
    return result


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> LocatedList:
    items = [loader.construct_object(child, deep=True) for child in node.value]
    return LocatedList(items, _line(node), [_line(child) for child in node.value])


def _construct_str(loader: _Loader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    if loader.on_string is None:
        return text
    return loader.on_string(text, _line(node), node.style is not None)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)
_Loader.add_constructor("tag:yaml.org,2002:seq", _construct_sequence)
_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)


def load_yaml(
    text: str, label: str, *, error: type[QuantkitError] = QuantkitError, on_string: OnString | None = None
) -> Any:
    """The document of ``text`` with located mappings and lists (None when empty).

    ``on_string`` rewrites every string scalar (``${VAR}`` substitution); a syntax error or a duplicate key
    raises ``error`` naming ``label:line``.
    """
    loader = _Loader(text)
    loader.label, loader.error, loader.on_string = label, error, on_string
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = format_where(label, mark.line + 1 if mark else None)
        raise error(f"{where}: invalid YAML: {exc.problem or exc.context}; fix the syntax there") from exc
    except yaml.YAMLError as exc:
        raise error(f"{label}: invalid YAML ({exc}); fix the syntax") from exc
    finally:
        loader.dispose()


# --------------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------------


class _Pairs(list):
    """A JSON object as its (key, value) pairs, duplicates kept (``object_pairs_hook``)."""


def load_json(
    text: str, label: str, *, error: type[QuantkitError] = QuantkitError, fix: str = "fix the syntax there"
) -> Any:
    """The JSON value of ``text`` with located objects and arrays; a syntax error or duplicate key raises ``error``."""
    try:
        value = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as exc:
        raise error(f"{label}:{exc.lineno}: not valid JSON ({exc.msg}); {fix}") from exc
    return _json_tree(value, _compose(text), label, error)


def _compose(text: str) -> yaml.Node | None:
    """The YAML node tree of a JSON text, for positions only; None when PyYAML cannot read it."""
    try:
        return yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return None


def _json_tree(value: Any, node: yaml.Node | None, label: str, error: type[QuantkitError]) -> Any:
    """``value`` as located containers, positions read from ``node`` while its shape matches."""
    if isinstance(value, _Pairs):
        pairs = node.value if isinstance(node, yaml.MappingNode) and len(node.value) == len(value) else None
        out = LocatedDict(where=_line(node) if pairs is not None else None)
        for i, (key, item) in enumerate(value):
            key_node, item_node = pairs[i] if pairs is not None else (None, None)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.value != key:
                key_node = item_node = None
            line = _line(key_node) if key_node is not None else None
            if key in out:
                raise error(f"{format_where(label, line)}: duplicate key '{key}'; keep one")
            out[key] = _json_tree(item, item_node, label, error)
            if line is not None:
                out.key_where[key] = line
        return out
    if isinstance(value, list):
        fits = isinstance(node, yaml.SequenceNode) and len(node.value) == len(value)
        nodes = node.value if fits else [None] * len(value)
        items = [_json_tree(v, n, label, error) for v, n in zip(value, nodes, strict=True)]
        return LocatedList(items, _line(node) if fits else None, [_line(n) if n else None for n in nodes])
    return value
