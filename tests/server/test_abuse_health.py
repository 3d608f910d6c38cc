"""Issue #39 item 7: /health reflects the engine (503 while its thread is dead or its recent steps all fail), /metrics
counts the failures, and a client never sees the internal exception (device, memory, paths): a generic error naming
the request id, whose details are in the server log."""

from __future__ import annotations

import json
import logging

import httpx

from server.support import MODEL, metric, wait_for

BODY = {"model": MODEL, "prompt": "the a", "max_tokens": 3}
SECRET = "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total) in /srv/models/secret"


def test_failing_steps_make_health_503_and_hide_the_exception(serve, monkeypatch, caplog):
    srv = serve()
    engine = srv.state.engine.engine

    def oom(*args, **kwargs):
        raise RuntimeError(SECRET)

    monkeypatch.setattr(engine.runner, "forward", oom)
    with caplog.at_level(logging.ERROR):
        answers = [httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=30) for _ in range(3)]
        streamed = httpx.post(f"{srv.url}/v1/completions", json={**BODY, "stream": True}, timeout=30)
    for resp in [*answers, streamed]:
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["code"] == "internal_error" and "request id" in error["message"]
        assert "CUDA" not in resp.text and "GiB" not in resp.text and "secret" not in resp.text
        rid = error["message"].split("request id ")[1].split(")")[0]
        assert any(rid in r.getMessage() for r in caplog.records), "the request id is not in the log"
    assert any(SECRET in r.getMessage() for r in caplog.records)  # the details are logged
    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    text = httpx.get(f"{srv.url}/metrics").text
    assert metric(text, "quantkit_engine_healthy") == 0
    assert (
        metric(text, "quantkit_engine_failed_steps_total") >= 3 and metric(text, "quantkit_request_errors_total") == 4
    )
    monkeypatch.undo()  # the device recovers: the next step succeeds and /health follows
    assert httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=30).status_code == 200
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}


def test_a_dead_engine_thread_makes_health_and_requests_503(serve, monkeypatch):
    srv = serve()

    def die(*args, **kwargs):
        raise SystemExit("the engine thread is gone")  # not an Exception: nothing in the loop catches it

    monkeypatch.setattr(srv.state.engine.engine, "step", die)
    first = httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=30)
    assert first.status_code == 503 and first.json()["error"]["code"] == "internal_error", first.text
    assert wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503)
    assert httpx.get(f"{srv.url}/health").json()["status"] == "unhealthy"
    later = httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=10)
    assert later.status_code == 503 and json.loads(later.text)["error"]["code"] == "engine_unavailable"
    assert metric(httpx.get(f"{srv.url}/metrics").text, "quantkit_engine_healthy") == 0
