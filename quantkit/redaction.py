"""The one rule for secrets in anything quantkit writes or prints (reports, a validated recipe, argv, logs):
the values of secret-named variables a recipe substituted (``HF_TOKEN``, ``OPENAI_API_KEY``, ``DB_PASSWORD``),
the values given to secret-named command-line options (``--api-key``, ``--token``), and strings shaped like the
common token formats (Hugging Face, OpenAI, GitHub, Slack, AWS access keys), wherever they appear."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# a variable or option whose name has one of these words holds a secret
SECRET_WORDS = {"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "CREDENTIALS", "AUTH"}
REDACTED = "<redacted ${{{name}}}>"  # a substituted variable's value
REDACTED_VALUE = "<redacted>"  # a value recognised by its shape or by the option that carried it
TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{30,}|sk-(?:proj-)?[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})\b"
)


def is_secret_name(name: str) -> bool:
    """``HF_TOKEN``, ``api-key``, ``--api-key``: a name with a secret word between its separators."""
    return any(word in SECRET_WORDS for word in re.split(r"[-_.]+", name.strip("-").upper()))


def redact(value: Any, secrets: Mapping[str, str] | None = None) -> Any:
    """``value`` (strings, lists, dicts, at any depth) with every secret replaced: the known ``secrets``
    (variable name -> value) by ``<redacted ${NAME}>``, token-shaped strings by ``<redacted>``."""
    if isinstance(value, str):
        for name, secret in (secrets or {}).items():
            if secret:
                value = value.replace(secret, REDACTED.format(name=name))
        return TOKEN_SHAPES.sub(REDACTED_VALUE, value)
    if isinstance(value, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    return value


def redact_argv(argv: Sequence[str], secrets: Mapping[str, str] | None = None) -> list[str]:
    """A command line with the values of secret-named options (``--api-key X``, ``--token=X``) hidden, then
    :func:`redact` applied to every word."""
    words: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            words.append(REDACTED_VALUE)
            hide_next = False
            continue
        option, eq, _ = word.partition("=")
        if word.startswith("--") and is_secret_name(option):
            if eq:
                words.append(f"{option}={REDACTED_VALUE}")
                continue
            hide_next = True
        words.append(word)
    return redact(words, secrets)
