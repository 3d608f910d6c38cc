"""`quantkit serve` and `quantkit bench` take every EngineConfig field as an option (derived in one place), the old
`--kv-cache-blocks` spelling still works, hidden, and the serving commands set the serving allocator policy."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.cli import run_cli

import quantkit.server.runner
from quantkit.cli import serving
from quantkit.runtime.config import EngineConfig
from quantkit.server.config import ServeConfig

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def _options(command: str) -> dict[str, object]:
    from typer.main import get_command

    from quantkit.cli import app

    params = get_command(app).commands[command].params  # type: ignore[attr-defined]
    return {p.name: p for p in params}


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_every_engine_field_is_an_option_with_its_default_and_help(command):
    options = _options(command)
    for field in dataclasses.fields(EngineConfig):
        option = options[field.name]
        assert f"--{field.name.replace('_', '-')}" in option.opts, field.name
        assert option.default == field.default and not option.hidden, field.name
        assert option.help and len(option.help) > 10, field.name
    assert options["kv_cache_blocks"].hidden and options["kv_cache_blocks"].opts == ["--kv-cache-blocks"]


def _serve(monkeypatch, capsys, *args: str) -> tuple[int, str, list[ServeConfig], list[str]]:
    """`quantkit serve` with the server itself replaced: the config it would have run, and the policy calls."""
    configs: list[ServeConfig] = []
    calls: list[str] = []
    monkeypatch.setattr(quantkit.server.runner, "serve", lambda model, config: configs.append(config))
    monkeypatch.setattr(serving, "keep_freed_memory_for_reuse", lambda: calls.append("serving policy"))
    code, _, err = run_cli(["serve", "some-model", *args], capsys)
    return code, err, configs, calls


def test_serve_passes_every_engine_option_in_one_engine_config(monkeypatch, capsys):
    args = ["--num-kv-blocks", "7", "--max-num-batched-tokens", "300", "--seed", "5", "--no-enable-prefix-caching"]
    code, err, configs, calls = _serve(monkeypatch, capsys, *args, "--max-queue", "3", "--block-size", "8")
    assert code == 0, err
    [config] = configs
    want = EngineConfig(num_kv_blocks=7, max_num_batched_tokens=300, seed=5, enable_prefix_caching=False, block_size=8)
    assert config.engine == want and config.max_queue == 3
    assert calls == ["serving policy"]


def test_the_old_kv_cache_blocks_spelling_still_works(monkeypatch, capsys):
    code, err, configs, _ = _serve(monkeypatch, capsys, "--kv-cache-blocks", "256")
    assert code == 0, err
    assert configs[0].engine.num_kv_blocks == 256
    code, err, configs, _ = _serve(monkeypatch, capsys, "--kv-cache-blocks", "256", "--num-kv-blocks", "8")
    assert code == 2 and not configs
    assert "--kv-cache-blocks is the old name of --num-kv-blocks" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--block-size", "0"], "block_size"), (["--backend", "cuda-magic"], "backend"), (["--dtype", "int3"], "dtype")],
)
def test_a_bad_engine_option_is_one_line_before_anything_loads(monkeypatch, capsys, args, words):
    code, err, configs, calls = _serve(monkeypatch, capsys, *args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not configs and not calls


def test_max_num_batched_tokens_defaults_to_a_whole_prompt():
    """Without chunked prefill a prompt of max_model_len tokens must fit one step (serve's rule before #38)."""
    assert EngineConfig().max_num_batched_tokens == 4096
    assert EngineConfig(max_model_len=512).max_num_batched_tokens == 4096
    assert EngineConfig(max_model_len=8192).max_num_batched_tokens == 8192
    assert EngineConfig(max_model_len=8192, max_num_batched_tokens=64).max_num_batched_tokens == 64


def test_every_server_field_is_a_serve_option_with_its_default_and_help():
    """Issue #39 item 8: the server's limits are ServeConfig fields with help metadata, derived into options."""
    options = _options("serve")
    for field in dataclasses.fields(ServeConfig):
        if field.name == "engine":
            continue
        option = options[field.name]
        assert f"--{field.name.replace('_', '-')}" in option.opts, field.name
        assert option.default == field.default and option.help == field.metadata["help"], field.name
    for name in ("header_timeout", "write_timeout", "keep_alive_timeout", "max_connections", "max_header_bytes"):
        assert name in options, name


def test_api_key_may_be_given_more_than_once(monkeypatch, capsys):
    code, err, configs, _ = _serve(monkeypatch, capsys, "--api-key", "a", "--api-key", "b", "--write-timeout", "3")
    assert code == 0, err
    [config] = configs
    assert config.api_keys == ("a", "b") and config.salts_cache_per_key and config.write_timeout == 3
    code, err, configs, _ = _serve(monkeypatch, capsys, "--api-key", "a", "--api-key", "a")
    assert code == 2 and "twice" in err and not configs
    monkeypatch.setenv("QUANTKIT_API_KEY", "from-env")
    code, err, configs, _ = _serve(monkeypatch, capsys)
    assert code == 0 and configs[0].api_keys == ("from-env",) and not configs[0].salts_cache_per_key
