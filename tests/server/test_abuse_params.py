"""Issue #39 item 5: parameters that change what is generated are either implemented (logit_bias, stop_token_ids,
min_tokens, as OpenAI and vLLM define them) or refused with a 400 naming them; harmless ones stay accepted."""

from __future__ import annotations

import httpx
import pytest

from server.support import MODEL

BASE = {"model": MODEL, "prompt": "the a of", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
EOS = 2  # the tiny model's


@pytest.fixture(scope="module")
def url(long_model_dir):
    from quantkit.server import ServerThread, create_app
    from server.support import tiny_config

    with ServerThread(create_app(long_model_dir, tiny_config())) as srv:
        yield srv.url


def _complete(url: str, **fields) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json={**BASE, **fields}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _token_ids(url: str, **fields) -> list[int]:
    body = _complete(url, logprobs=0, return_tokens_as_token_ids=True, **fields)
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_logit_bias_bans_and_forces_tokens(url):
    free = _token_ids(url)
    assert _token_ids(url, logit_bias={str(free[0]): -100})[0] != free[0]
    assert _token_ids(url, logit_bias={"9": 100}, temperature=0.8, seed=3) == [9] * 6
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "she"}], "max_tokens": 4, "temperature": 0}
    forced = httpx.post(f"{url}/v1/chat/completions", json={**chat, "logit_bias": {"9": 100}}, timeout=60).json()
    plain = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
    assert forced["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]


def test_stop_token_ids_and_min_tokens(url):
    free = _token_ids(url)
    stop = free[3]
    done = _complete(url, stop_token_ids=[stop])
    assert done["choices"][0]["finish_reason"] == "stop"
    assert done["usage"]["completion_tokens"] == free.index(stop) + 1
    eos_now = {"ignore_eos": False, "logit_bias": {str(EOS): 100}}  # EOS forced at the first step
    assert _complete(url, **eos_now)["usage"]["completion_tokens"] == 1
    held = _complete(url, **eos_now, min_tokens=4)
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
    resp = httpx.post(f"{url}/v1/completions", json={**BASE, "min_tokens": 7})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize(
    ("route", "name", "value"),
    [
        ("completions", "response_format", {"type": "json_object"}),
        ("chat/completions", "response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("chat/completions", "tool_choice", "required"),
        ("completions", "repetition_penalty", 1.3),
        ("completions", "best_of", 3),
        ("chat/completions", "best_of", 2),
        ("chat/completions", "echo", True),
        ("completions", "min_p", 0.1),
        ("completions", "guided_json", {"type": "object"}),
        ("chat/completions", "top_logprobs", 3),
        ("completions", "include_stop_str_in_output", True),
    ],
)
def test_unimplemented_parameters_get_400_naming_them(url, route, name, value):
    body = {"model": MODEL, "max_tokens": 2, name: value}
    body |= {"messages": [{"role": "user", "content": "she"}]} if route.startswith("chat") else {"prompt": "she"}
    resp = httpx.post(f"{url}/v1/{route}", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_parameter" and name in error["message"]


def test_neutral_and_harmless_parameters_are_accepted(url):
    harmless = {
        "repetition_penalty": 1.0, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
        "user": "u-1", "metadata": {"team": "a"}, "store": False, "best_of": 1, "parallel_tool_calls": True,
    }  # fmt: skip
    assert _complete(url, **harmless)["choices"][0]["text"] == _complete(url)["choices"][0]["text"]
