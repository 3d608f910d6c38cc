"""Which ``${VAR}`` names hold secrets, and how their values are redacted."""

from __future__ import annotations

import pytest

from quantkit.recipes.overrides import is_secret_name, redact
from quantkit.recipes.schema import recipe_from_text, recipe_secrets


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("OPENAI_API_KEY", True),
        ("DB_PASSWORD", True),
        ("aws_secret_access_key", True),
        ("NUM_TOKENS", False),
        ("KEYBOARD", False),
        ("QUANTKIT_OUT", False),
    ],
)
def test_secret_names(name, secret):
    assert is_secret_name(name) is secret


def test_redact_walks_strings_only():
    data = {"a": "x-hunter2-y", "n": 1234, "l": ["hunter2", 5], "hunter2": True}
    assert redact(data, {"PASS": "hunter2"}) == {
        "a": "x-<redacted ${PASS}>-y",
        "n": 1234,
        "l": ["<redacted ${PASS}>", 5],
        "<redacted ${PASS}>": True,
    }


def test_recipe_records_secret_substitutions_from_text_and_overrides(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    monkeypatch.setenv("OUT", "out")
    text = 'model: m-${HF_TOKEN}\noutput: {directory: "${OUT}"}\n'
    recipe = recipe_from_text(text, overrides=["calibration.dataset=${MY_SECRET:-fallback-secret}"])
    assert recipe.model == "m-hf_abc"
    assert recipe_secrets(recipe) == {"HF_TOKEN": "hf_abc", "MY_SECRET": "fallback-secret"}
