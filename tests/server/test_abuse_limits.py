"""Issue #39 items 3, 4 and 8: limits checked before expensive work, and connection limits.

3. Stop strings are bounded in count (16) and length (256 characters): every one is searched on every token.
4. The Unicode check reads only the strings the server uses; a token-id prompt is checked (count, vocabulary, 2**32)
   before it is decoded; the 429 capacity check comes before tokenizing; the default body limit follows the context.
8. Slow request heads are cut after --header-timeout, connections beyond --max-connections are refused, an oversized
   request head gets a 400 error object.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from quantkit.server.config import ServeConfig
from quantkit.server.routes import generation
from server.support import MODEL, connect, metric, read_all, wait_for

BODY = {"model": MODEL, "prompt": "the a", "max_tokens": 2}


def _error(resp: httpx.Response, status: int, param: str) -> dict:
    """The error object of a ``status`` answer whose param is ``param`` (or names an element of it)."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] in (param, *(f"{param}.{i}" for i in range(10))) and error["message"], error
    return error


# ----------------------------------------------------------------- 3. stop strings
def test_stop_strings_are_bounded_in_count_and_length(serve):
    srv = serve()
    url = f"{srv.url}/v1/completions"
    error = _error(httpx.post(url, json={**BODY, "stop": [f"s{i}" for i in range(10_000)]}), 400, "stop")
    assert "16" in error["message"]
    _error(httpx.post(url, json={**BODY, "stop": ["x" * 257]}), 400, "stop")
    _error(httpx.post(url, json={**BODY, "stop": "x" * 257}), 400, "stop")
    most = {**BODY, "stop": ["zz" + "y" * 254 for _ in range(16)]}
    assert httpx.post(url, json=most, timeout=30).status_code == 200


# ----------------------------------------------------------------- 4. cheap checks first
@pytest.mark.parametrize("ids", [[5, 2**40], [5, 2**32], [5, 300]])
def test_token_ids_outside_the_vocabulary_are_400_with_or_without_echo(serve, ids):
    srv = serve()
    for echo in (False, True):
        body = {**BODY, "prompt": ids, "echo": echo}
        error = _error(httpx.post(f"{srv.url}/v1/completions", json=body), 400, "prompt")
        assert "vocabulary" in error["message"] or "less than" in error["message"], error


def test_a_long_token_id_prompt_is_refused_before_it_is_decoded(serve, monkeypatch):
    srv = serve()
    decoded: list[int] = []
    monkeypatch.setattr(generation, "decode", lambda tok, ids: decoded.append(len(ids)) or "")
    body = {**BODY, "prompt": [5] * 50_000, "echo": True}
    error = _error(httpx.post(f"{srv.url}/v1/completions", json=body), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and decoded == []
    assert httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": [5, 6]}).status_code == 200
    assert decoded == [2]  # the spy sees the decoding of a prompt that passes the checks


def test_a_full_server_refuses_before_tokenizing(serve, monkeypatch):
    srv = serve(engine={"max_num_seqs": 1}, max_queue=0)
    srv.state.engine.pause()
    waiting = threading.Thread(target=lambda: httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=60))
    waiting.start()
    try:
        assert wait_for(lambda: srv.state.engine.num_in_flight == 1)
        calls: list[str] = []
        run = srv.state.tokenizer.run

        async def counted(fn, *args):
            calls.append(fn.__name__)
            return await run(fn, *args)

        monkeypatch.setattr(srv.state.tokenizer, "run", counted)
        for route, body in (("completions", {**BODY, "prompt": "the " * 500}), ("chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "the " * 500}]})):  # fmt: skip
            resp = httpx.post(f"{srv.url}/v1/{route}", json=body)
            assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full"
        assert calls == []  # no tokenizing for a request that cannot be queued
    finally:
        srv.state.engine.resume()
        waiting.join(60)


def test_ignored_fields_are_never_walked(serve):
    """The Unicode check used to walk every element of the body, ignored extra fields included: a lone surrogate in
    a field nobody reads was a 400, and every element of a large ignored array was visited on the event loop."""
    srv = serve()
    body = json.dumps({**BODY, "metadata": {"note": "\ud800"}, "junk": list(range(100_000))})
    start = time.perf_counter()
    resp = httpx.post(f"{srv.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert time.perf_counter() - start < 5


def test_the_default_body_limit_follows_the_context(serve):
    assert ServeConfig().resolved_max_body_bytes(2048) == (1 << 20) + 192 * 2048
    assert ServeConfig().resolved_max_body_bytes(131072) == 4 << 20
    assert ServeConfig(max_body_bytes=123).resolved_max_body_bytes(2048) == 123
    srv = serve()
    big = json.dumps({**BODY, "prompt": [5] * 600_000})  # 1.8 MB: more than a 2048-token request can need
    resp = httpx.post(f"{srv.url}/v1/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


# ----------------------------------------------------------------- 8. connection limits
def test_a_slow_request_head_is_cut_after_the_header_timeout(serve):
    srv = serve(header_timeout=0.5)
    trickle, silent = connect(srv), connect(srv)
    try:
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        start = time.monotonic()
        answer = read_all(trickle, timeout=10)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert time.monotonic() - start < 5
        assert read_all(silent, timeout=10).startswith(b"HTTP/1.1 408")  # a connection that sends nothing too
    finally:
        trickle.close()
        silent.close()
    assert metric(httpx.get(f"{srv.url}/metrics").text, "quantkit_header_timeouts_total") == 2
    assert httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=30).status_code == 200


def test_connections_over_the_limit_are_refused_with_an_error_object(serve):
    srv = serve(max_connections=3)
    held = [connect(srv) for _ in range(3)]
    try:
        time.sleep(0.2)
        extra = connect(srv)
        answer = read_all(extra, timeout=10)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    assert wait_for(lambda: httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=30).status_code == 200)
    assert metric(httpx.get(f"{srv.url}/metrics").text, "quantkit_connections_refused_total") >= 1


def test_an_oversized_request_head_gets_a_400_error_object(serve):
    srv = serve(max_header_bytes=4096)
    resp = httpx.post(f"{srv.url}/v1/completions", json=BODY, headers={"x-padding": "p" * 8000})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_http_request"
    assert httpx.post(f"{srv.url}/v1/completions", json=BODY, headers={"x-padding": "p" * 1000}).status_code == 200
