"""What a recipe's text becomes before validation: ``${VAR}`` substitution and ``--set a.b=c`` overrides.

``${VAR}`` and ``${VAR:-default}`` are replaced in every string; an unquoted value is re-typed as YAML after
substitution, so ``bits: ${BITS:-4}`` is an integer. ``--set a.b.c=value`` sets a key (creating intermediate
mappings); the value is parsed as YAML (``8`` is an int) and its location reads ``--set a.b.c=value``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from quantkit.errors import QuantkitError
from quantkit.redaction import is_secret_name
from quantkit.schemas.located import LocatedDict, OnString, located

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RecipeError(QuantkitError):
    """An invalid recipe: the message names the file, the line and the key path."""


def substitute_env(text: str, where: str, secrets: dict[str, str] | None = None) -> str:
    """``text`` with ``${VAR}`` and ``${VAR:-default}`` replaced; an unset variable without a default is an error.
    Values of secret-named variables are recorded in ``secrets`` (name -> value)."""

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                raise RecipeError(
                    f"{where}: environment variable '{name}' is not set and has no default; "
                    f"export it or write ${{{name}:-default}}"
                )
            value = default
        if secrets is not None and value and is_secret_name(name):
            secrets[name] = value
        return value

    return _ENV.sub(replace, text)


def env_substitution(label: str, secrets: dict[str, str] | None = None) -> OnString:
    """A ``load_yaml`` string hook that substitutes ``${VAR}``; returns the scalar's (re-typed) value."""

    def on_string(text: str, line: int, quoted: bool) -> Any:
        if "${" not in text:
            return text
        substituted = substitute_env(text, f"{label}:{line}", secrets)
        if not quoted:  # type the result as YAML would (${BITS:-4} -> 4)
            typed = yaml.safe_load(substituted) if substituted.strip() else None
            if not isinstance(typed, (dict, list)):
                return typed
        return substituted

    return on_string


def apply_overrides(data: LocatedDict, overrides: list[str], label: str, secrets: dict[str, str] | None = None) -> None:
    """Apply each ``a.b.c=value`` to ``data`` in place; a malformed expression or a non-mapping on the way fails."""
    for expr in overrides:
        path, sep, raw = expr.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise RecipeError(f"--set {expr!r}: expected KEY.PATH=VALUE, e.g. --set quantization.scheme.bits=8")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise RecipeError(f"--set {expr!r}: the value is not valid YAML ({exc})") from exc
        where = f"--set {expr}"
        if isinstance(value, str) and "${" in value:
            value = substitute_env(value, where, secrets)
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if not isinstance(child, LocatedDict):
                if child is not None:
                    at = ".".join(keys[: depth + 1])
                    raise RecipeError(f"{label} ({where}): '{at}' is not a mapping, cannot set a key in it")
                child = LocatedDict(where=where)
                node[key] = child
                node.key_where[key] = where
            node = child
        node[keys[-1]] = located(value, where)
        node.key_where[keys[-1]] = where
