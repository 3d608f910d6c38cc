"""docs/serving.md's generated blocks: the serve options have one home each (a ServeConfig or EngineConfig field's
default and help, turned into the command's options by quantkit/cli/engine_options.py), so their tables are rendered
from the command itself, as `quantkit serve --help` shows them; the request limits are rendered from the constants
the checks use."""

from __future__ import annotations


def _serve_params(config: type) -> list:
    import dataclasses

    import typer.main

    from quantkit.cli import app

    names = {f.name for f in dataclasses.fields(config)}
    command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    return [p for p in command.params if p.name in names and not getattr(p, "hidden", False)]


def serve_options_markdown(config: type) -> str:
    """``quantkit serve``'s options made from ``config``'s fields, as a markdown table."""
    lines = ["| option | default | what it sets |", "|---|---|---|"]
    for param in _serve_params(config):
        flags = "/".join([*param.opts, *param.secondary_opts])
        default = "-" if param.default is None else f"`{param.default}`"
        env = f" Environment: `{param.envvar}`." if param.envvar else ""
        help_ = (param.help or "").replace("|", "\\|")
        lines.append(f"| `{flags}` | {default} | {help_}{env} |")
    return "\n".join(lines)


def _power_of_two(n: int) -> str:
    return f"2**{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def request_limits_markdown() -> str:
    """The limits one request meets, each read from the constant (or schema bound) the server checks it with."""
    from quantkit.runtime.sampling_params import (
        MAX_BIAS,
        MAX_LOGIT_BIAS,
        MAX_STOP_CHARS,
        MAX_STOP_STRINGS,
        MAX_STOP_TOKEN_IDS,
        MIN_TEMPERATURE,
    )
    from quantkit.server.config import BODY_BYTES_BASE, BODY_BYTES_PER_TOKEN, MAX_DEFAULT_BODY_BYTES
    from quantkit.server.protocol import MAX_LOGPROBS
    from quantkit.server.requests import MAX_CACHE_SALT_CHARS, CompletionRequest
    from quantkit.server.routes.generation import CHARS_PER_TOKEN_LIMIT

    schema = CompletionRequest.model_json_schema()["properties"]
    priority = schema["priority"]
    token_id_bound = schema["prompt"]["anyOf"][1]["items"]["exclusiveMaximum"]
    seed_bound = schema["seed"]["anyOf"][0]["exclusiveMaximum"]
    rows = [
        ("`stop`", f"at most {MAX_STOP_STRINGS} strings, each 1 to {MAX_STOP_CHARS} characters"),
        ("`stop_token_ids`", f"at most {MAX_STOP_TOKEN_IDS} ids, each below the vocabulary size"),
        (
            "`logit_bias`",
            f"at most {MAX_LOGIT_BIAS} entries; keys are token ids as decimal strings, below the vocabulary size; "
            f"biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
        ),
        ("`temperature`", f">= 0; below {MIN_TEMPERATURE:g} samples greedily"),
        ("`top_k`", "-1 (off) or >= 1; above the vocabulary size keeps every token"),
        ("`logprobs`", f"0 to {MAX_LOGPROBS} (/v1/completions only)"),
        ("`priority`", f"an integer from {priority['minimum']} to {priority['exclusiveMaximum'] - 1}"),
        ("`seed`", f"an integer from 0 to {_power_of_two(seed_bound)} - 1"),
        ("`cache_salt`", f"1 to {MAX_CACHE_SALT_CHARS} characters"),
        ("`max_tokens`, `max_completion_tokens`", "at most the context (`--max-model-len`)"),
        (
            "prompt text, chat messages",
            f"at most {CHARS_PER_TOKEN_LIMIT} characters per context token, counted before tokenizing; then prompt "
            "+ `max_tokens` tokens within the context",
        ),
        (
            "prompt token ids",
            f"at most the context's length; each below the vocabulary size (and {_power_of_two(token_id_bound)})",
        ),
        (
            "request body",
            f"`--max-body-bytes`; by default {BODY_BYTES_PER_TOKEN} bytes per context token + "
            f"{BODY_BYTES_BASE / 2**20:g} MiB, at most {MAX_DEFAULT_BODY_BYTES / 2**20:g} MiB",
        ),
    ]
    lines = ["| field | limit |", "|---|---|"] + [f"| {field} | {limit} |" for field, limit in rows]
    return "\n".join(lines)


def unsupported_markdown() -> str:
    from quantkit.server.unsupported import UNSUPPORTED

    return ", ".join(f"`{name}`" + (" (chat)" if rule.chat_only else "") for name, rule in UNSUPPORTED.items())


def serving_blocks() -> dict[str, str]:
    from quantkit.runtime.config import EngineConfig
    from quantkit.server.config import ServeConfig

    return {
        "serve-options": serve_options_markdown(ServeConfig),
        "engine-options": serve_options_markdown(EngineConfig),
        "request-limits": request_limits_markdown(),
        "unsupported-parameters": unsupported_markdown(),
    }
