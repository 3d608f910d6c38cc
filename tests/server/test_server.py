"""The OpenAI-compatible server over real loopback HTTP: routes, streaming, errors, backpressure, disconnects, drain."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers.cli import run_cli
from helpers.paths import REPO
from helpers.tiny import save_tiny_model

from quantkit.runtime.config import EngineConfig
from quantkit.server import ServeConfig, ServerThread, create_app
from quantkit.server.runner import drain

MODEL = "tiny"
LONG = 1900  # completion tokens for a request that is still running when the test acts on it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny word-level model with a 2048-token context (long generations for disconnect/drain tests)."""
    return save_tiny_model(tmp_path_factory.mktemp("serve") / "model", max_position_embeddings=2048)


def _config(engine: dict | None = None, **kw) -> ServeConfig:
    return ServeConfig(port=0, served_model_name=MODEL, engine=EngineConfig(num_kv_blocks=256, **(engine or {})), **kw)


@pytest.fixture(scope="module")
def srv(model_dir):
    with ServerThread(create_app(model_dir, _config())) as server:
        yield server


@pytest.fixture()
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def _events(lines) -> list[str]:
    """SSE payloads; asserts every non-empty line is a `data: ` line."""
    out = []
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            out.append(line[6:])
    return out


def _wait(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _idle(srv) -> bool:
    eng = srv.state.engine
    bm = eng.engine.block_manager
    return eng.num_in_flight == 0 and not eng.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


# ----------------------------------------------------------------- routes
def test_health_models_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    client.post("/v1/completions", json={"model": MODEL, "prompt": "the a of", "max_tokens": 4})
    text = client.get("/metrics").text
    for series in (
        'quantkit_requests_total{route="/v1/completions",code="200"}',
        f'vllm:prompt_tokens_total{{model_name="{MODEL}"}}',
        f'vllm:generation_tokens_total{{model_name="{MODEL}"}}',
        f'vllm:num_requests_running{{model_name="{MODEL}"}}',
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}}',
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}}',
        f'vllm:num_preemptions_total{{model_name="{MODEL}"}}',
        f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="length"}}',
        f'vllm:time_to_first_token_seconds_bucket{{model_name="{MODEL}",le="+Inf"}}',
        f'vllm:request_time_per_output_token_seconds_count{{model_name="{MODEL}"}}',
        f'vllm:e2e_request_latency_seconds_sum{{model_name="{MODEL}"}}',
        "quantkit_num_requests_in_flight",
        "quantkit_kv_cache_free_blocks",
        "process_resident_memory_bytes",
    ):
        assert series in text, series
    assert re.search(r"^vllm:generation_tokens_total\{[^}]*\} [1-9]", text, re.M)
    assert re.search(r"^vllm:prompt_tokens_total\{[^}]*\} [1-9]", text, re.M)


def test_openai_client_completions_and_chat(srv):
    api = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    done = api.completions.create(model=MODEL, prompt="the a of", max_tokens=6, temperature=0, seed=1, user="u")
    assert done.object == "text_completion" and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    streamed = api.completions.create(model=MODEL, prompt="the a of", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "she was"}]
    chat = api.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    chunks = list(api.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert [m.id for m in api.models.list()] == [MODEL]


def test_streaming_framing(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the"}], "max_tokens": 5, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = _events(resp.iter_lines())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 5


def test_stop_string_is_cut_streamed_or_not(client):
    body = {"model": MODEL, "prompt": "she was", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    words = client.post("/v1/completions", json=body).json()["choices"][0]["text"].split()
    stop = words[2]
    text = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stop not in text["text"] and text["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as resp:
        events = _events(resp.iter_lines())
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text["text"]


# ----------------------------------------------------------------- errors
BAD = [
    ({"model": "other", "prompt": "the"}, "model"),
    ({"model": MODEL, "prompt": "the", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "the", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "the", "top_k": 0}, "top_k"),
    ({"model": MODEL, "prompt": "the", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "the", "n": 2}, "n"),
    ({"model": MODEL, "prompt": "the", "presence_penalty": 1}, "presence_penalty"),
    ({"model": MODEL, "prompt": "the", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": ["the", "a"]}, "prompt"),
    ({"model": MODEL, "prompt": [5, 99999]}, "prompt"),
    ({"model": MODEL, "prompt": "the " * 2100}, "prompt"),
    ({"model": MODEL}, "prompt"),
    # strict types: a bool is not an int or a number, a string is not a bool
    ({"model": MODEL, "prompt": "the", "max_tokens": True}, "max_tokens"),
    ({"model": MODEL, "prompt": "the", "temperature": True}, "temperature"),
    ({"model": MODEL, "prompt": "the", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": "the", "ignore_eos": 1}, "ignore_eos"),
    ({"model": MODEL, "prompt": "the", "top_k": "5"}, "top_k"),
    ({"model": MODEL, "prompt": "the", "max_tokens": 2049}, "max_tokens"),  # more than the 2048-token context
    ({"model": MODEL, "prompt": ""}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_requests_get_400_error_objects(client, body, param):
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_and_bad_chat(client):
    resp = client.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "malformed JSON" in resp.json()["error"]["message"]
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    long = {"model": MODEL, "messages": [{"role": "user", "content": "a " * 2100}]}
    assert client.post("/v1/chat/completions", json=long).json()["error"]["code"] == "context_length_exceeded"
    assert client.get("/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_api_key(model_dir):
    with ServerThread(create_app(model_dir, _config(api_key="sekret"))) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for route in ("/v1/models", "/metrics"):
                resp = httpx.get(srv.url + route, headers=headers)
                assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        body = {"model": MODEL, "prompt": "the", "max_tokens": 2}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        api = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0, timeout=60)
        assert api.completions.create(**body).choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0).models.list()


def test_full_queue_gets_429_then_recovers(model_dir):
    app = create_app(model_dir, _config({"max_num_seqs": 1}, max_queue=1))
    with ServerThread(app) as srv:
        srv.state.engine.pause()  # a blocked engine: requests pile up
        body = {"model": MODEL, "prompt": "the a", "max_tokens": 3}
        codes: list[int] = []

        def post() -> None:
            codes.append(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code)

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        assert _wait(lambda: srv.state.engine.num_in_flight == 2)
        resp = httpx.post(f"{srv.url}/v1/completions", json=body)
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full"
        srv.state.engine.resume()
        for t in threads:
            t.join(30)
        assert codes == [200, 200]
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 200
        assert 'quantkit_requests_total{route="/v1/completions",code="429"} 1' in httpx.get(f"{srv.url}/metrics").text


# ----------------------------------------------------------------- disconnects and shutdown
def test_disconnect_mid_stream_aborts_and_frees_blocks(srv, client):
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        assert srv.state.engine.engine.has_unfinished()
    assert _wait(lambda: _idle(srv)), "the aborted request kept its sequence or blocks"
    metrics = client.get("/metrics").text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0' in metrics
    assert "quantkit_num_requests_in_flight 0" in metrics


@pytest.mark.slow
def test_disconnect_while_waiting_for_a_full_response_aborts(srv):
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.3)
    assert _wait(lambda: _idle(srv)), "the abandoned request kept running"


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(model_dir):
    cmd = [sys.executable, "-m", "quantkit", "serve", str(model_dir), "--port", "0", "--served-model-name", MODEL]
    cmd += ["--kv-cache-blocks", "256", "--drain-timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        url = _read_url(proc, timeout=120)
        body = {"model": MODEL, "prompt": "she was", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            assert _wait(lambda: httpx.get(f"{url}/health").status_code == 503, 10)
            refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            events = [first[6:], *_events(lines)]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _read_url(proc: subprocess.Popen, timeout: float) -> str:
    """The URL from the server's `serving ... at http://...` line."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            match = re.search(r"at (http://\S+)", line)
            if match:
                found.append(match.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        raise AssertionError(f"the server did not start: {proc.stderr.read()[-2000:]}")
    return found[0]


@pytest.mark.slow
def test_serving_imports_no_solver_code():
    code = (
        "import sys, quantkit.server.app, quantkit.server.runner, quantkit.server.smoke;"
        "print([m for m in sys.modules if m.split('.')[-1] in "
        "('gptq', 'awq', 'calibration', 'sensitivity', 'planner', 'pipeline', 'datasets', 'sklearn')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_serve_cli_refuses_a_bad_model(tmp_path, capsys):
    code, _, err = run_cli(["serve", str(tmp_path / "missing")], capsys)
    assert code == 2 and "not found" in err
    code, _, err = run_cli(["serve", str(tmp_path), "--max-queue", "-1"], capsys)
    assert code == 2 and "max_queue" in err
    code, _, err = run_cli(["serve", str(tmp_path), "--max-body-bytes", "0"], capsys)
    assert code == 2 and "max_body_bytes" in err


# ----------------------------------------------------------------- hostile input
CHAR_LIMIT = 32 * 2048  # CHARS_PER_TOKEN_LIMIT x max_model_len of the test model


@pytest.fixture()
def small_body_limit(srv):
    before, srv.state.max_body_bytes = srv.state.max_body_bytes, 1000
    yield
    srv.state.max_body_bytes = before


def test_body_over_the_limit_gets_413_before_it_is_parsed(client, small_body_limit):
    big = json.dumps({"model": MODEL, "prompt": "the " * 300})
    bad_json = b"{" * 2000  # malformed, but too big first: never parsed
    chunked = iter([b'{"model": "tiny", "prompt": "', b"the " * 300, b'"}'])  # no Content-Length
    for content in (big, bad_json, chunked):
        resp = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert resp.status_code == 413, resp.text
        error = resp.json()["error"]
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "the", "max_tokens": 2}).status_code == 200
    assert 'route="/v1/completions",code="413"} 3' in client.get("/metrics").text


def test_prompt_over_the_character_limit_gets_400_untokenized(client):
    prompt = "a" * (CHAR_LIMIT + 1)  # one word: would tokenize to one token and fit
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt" and f"at most {CHAR_LIMIT}" in error["message"]
    messages = [{"role": "user", "content": "a" * (CHAR_LIMIT // 2)}] * 2
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_prompts_are_tokenized_off_the_engine_thread(srv, client, monkeypatch):
    engine = srv.state.engine.engine
    seen: list[tuple[str, type]] = []
    encode = engine.encode

    def spy(prompt):
        seen.append((threading.current_thread().name, type(prompt)))
        return encode(prompt)

    monkeypatch.setattr(engine, "encode", spy)
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "the a", "max_tokens": 1}).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "the"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert len(seen) == 2 and all(kind is list for _, kind in seen), seen  # the engine only checks token ids


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "tiny", "prompt": "abc\\ud800def"}', "prompt"),
        (b'{"model": "tiny", "prompt": ["abc\\udfffdef"]}', "prompt"),
        (b'{"model": "tiny\\ud800", "prompt": "the"}', "model"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "abc\\ud800def"}]}', "messages"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages"),
    ],
)  # fmt: skip
def test_lone_surrogates_get_400(client, body, param):
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    resp = client.post(route, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_unicode" and error["param"] == param and "surrogate" in error["message"]


def test_api_key_scheme_is_case_insensitive_and_keys_may_be_non_ascii(model_dir):
    key = "clé-ключ-🔑"
    with ServerThread(create_app(model_dir, _config(api_key=key))) as srv:
        for auth in (f"Bearer {key}", f"bearer {key}", f"BEARER  {key}"):
            resp = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": auth.encode()})
            assert resp.status_code == 200, auth
        for auth in ("Bearer clé", f"Basic {key}", key, "bearer"):
            assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": auth.encode()}).status_code == 401


def test_no_local_path_reaches_a_client(model_dir, tmp_path):
    bare = tmp_path / "bare-model"  # no tokenizer: the engine's refusal of stop strings names its directory
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    with ServerThread(create_app(bare, ServeConfig(port=0, engine=EngineConfig(num_kv_blocks=64)))) as srv:
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == ["bare-model"]
        bodies = [
            {"model": str(bare), "prompt": [5, 6]},
            {"model": "bare-model", "prompt": [5, 6], "stop": ["x"]},
            {"model": "bare-model", "prompt": "the"},
        ]
        for body in bodies:
            resp = httpx.post(f"{srv.url}/v1/completions", json=body)
            assert resp.status_code == 400, resp.text
            assert str(tmp_path) not in resp.text and str(bare) not in resp.text, resp.text


def test_openapi_documents_400_and_value_ranges(client):
    doc = client.get("/openapi.json").json()
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][route]["post"]["responses"]
        assert "400" in responses and "422" not in responses, responses
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    fields = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["temperature"]["minimum"] == 0
    assert fields["top_p"]["exclusiveMinimum"] == 0 and fields["top_p"]["maximum"] == 1
    assert fields["top_k"]["minimum"] == -1
    # completions: 0 with echo scores the prompt only; chat: at least 1
    assert any(t.get("minimum") == 0 and t.get("maximum") == 2048 for t in fields["max_tokens"]["anyOf"])
    chat_max = doc["components"]["schemas"]["ChatRequest"]["properties"]["max_tokens"]["anyOf"]
    assert any(t.get("minimum") == 1 and t.get("maximum") == 2048 for t in chat_max)
    assert fields["model"]["enum"] == [MODEL]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/event-stream"} <= set(ok)


def test_wrong_method_gets_405_with_allow_and_unknown_role_400(client):
    resp = client.request("TRACE", "/v1/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST", resp.headers
    messages = [{"role": "narrator", "content": "hi"}]
    error = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).json()["error"]
    assert error["param"] == "messages.0.role", error


def test_requests_left_after_the_drain_timeout_end_with_error_objects(model_dir):
    with ServerThread(create_app(model_dir, _config())) as srv:
        body = {"model": MODEL, "prompt": "the a of", "max_tokens": LONG, "ignore_eos": True}
        plain: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: plain.append(httpx.post(f"{srv.url}/v1/completions", json=body)))
        waiting.start()
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line)
            assert _wait(lambda: srv.state.engine.num_in_flight == 2)
            srv.state.draining = True
            drain(srv.state, 0.1)
            events = [first[6:], *_events(lines)]
        waiting.join(30)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "shutting_down"
        assert "drain timeout" in plain[0].json()["error"]["message"]
        assert _wait(lambda: _idle(srv))


def test_a_slow_body_gets_408_without_holding_the_connection():
    import asyncio
    import time

    from quantkit.server.gate import read_body

    async def first_chunk_then_silence():
        yield {"type": "http.request", "body": b'{"model": ', "more_body": True}
        await asyncio.sleep(60)

    chunks = first_chunk_then_silence()

    async def receive():
        return await chunks.__anext__()

    start = time.perf_counter()
    result = asyncio.run(read_body({"headers": []}, receive, limit=1 << 20, timeout=0.2))
    assert time.perf_counter() - start < 2
    assert result.status == 408 and "--body-timeout" in result.message


def test_speculative_server_reports_acceptance_in_metrics(model_dir):
    """A server with n-gram speculation answers as without it and exposes the acceptance counters."""
    body = {"model": MODEL, "prompt": "the cat the cat the cat the cat", "max_tokens": 24, "temperature": 0}
    with ServerThread(create_app(model_dir, _config())) as plain_srv:
        plain = httpx.post(f"{plain_srv.url}/v1/completions", json=body).json()["choices"][0]["text"]
    with ServerThread(create_app(model_dir, _config({"speculative": "ngram", "num_speculative_tokens": 4}))) as srv:
        spec = httpx.post(f"{srv.url}/v1/completions", json=body).json()["choices"][0]["text"]
        metrics = httpx.get(f"{srv.url}/metrics").text
    assert spec == plain
    rate = re.search(r"^quantkit_spec_decode_acceptance_rate (\S+)", metrics, re.M)
    per_step = re.search(r"^quantkit_spec_decode_tokens_per_step (\S+)", metrics, re.M)
    assert rate and per_step and 0 < float(rate.group(1)) <= 1 and float(per_step.group(1)) > 1, metrics
