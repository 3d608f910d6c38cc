"""Which ``${VAR}`` names hold secrets, and how their values are redacted."""

from __future__ import annotations

import pytest

from quantkit.recipes.schema import recipe_from_text, recipe_secrets
from quantkit.redaction import is_secret_name, redact, redact_argv


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


TOKEN = "hf_" + "aB3" * 12  # shaped like a Hugging Face token


def test_token_shaped_strings_are_redacted_whatever_carries_them():
    text = f"model hub:{TOKEN} and sk-{'x' * 24} and AKIA{'A' * 16}"
    assert redact(text) == "model hub:<redacted> and <redacted> and <redacted>"
    assert redact({"k": [TOKEN]}, {}) == {"k": ["<redacted>"]}


def test_secret_options_on_a_command_line_are_redacted():
    argv = ["quantkit", "serve", "m", "--api-key", "s3cret", "--api-key=other", "--port", "8000", f"--set=x={TOKEN}"]
    assert redact_argv(argv) == [
        "quantkit", "serve", "m", "--api-key", "<redacted>", "--api-key=<redacted>", "--port", "8000",
        "--set=x=<redacted>",
    ]  # fmt: skip


def test_recipe_validate_prints_no_secret(tmp_path, monkeypatch, capsys):
    from helpers.cli import run_cli

    monkeypatch.setenv("HF_TOKEN", "plain-secret-value")
    path = tmp_path / "r.yaml"
    path.write_text('model: "org/m?token=${HF_TOKEN}"\noutput: {directory: o}\n')
    code, out, err = run_cli(["recipe", "validate", str(path)], capsys)
    assert code == 0, err
    assert "plain-secret-value" not in out and "<redacted ${HF_TOKEN}>" in out


def test_a_report_hides_secrets_given_on_the_command_line(tmp_path, monkeypatch):
    import json
    import sys

    from quantkit.recipes.report import environment

    monkeypatch.setattr(sys, "argv", ["quantkit", "run", "r.yaml", "--set", f"model=org/m?token={TOKEN}"])
    assert TOKEN not in json.dumps(environment()) and "<redacted>" in environment()["argv"]
