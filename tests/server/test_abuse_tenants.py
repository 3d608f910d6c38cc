"""Issue #39 items 9 and 10: with several API keys each key gets a prefix cache of its own (by default; vLLM's
cache_salt per request too), the waiting queue is shared fairly between keys, a full server makes room for a key
holding fewer requests, and vLLM's priority orders a key's requests (queue time per priority in /metrics)."""

from __future__ import annotations

import threading

import httpx

from server.support import MODEL, metric, wait_for

KEYS = ("key-of-a", "key-of-b")
PROMPT = " ".join(["the", "a", "of", "and", "to", "in", "was", "her"] * 5)  # 40 tokens: 2 full blocks of 16


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cached_tokens(srv, monkeypatch) -> list[int]:
    """The prefix-cache hits of every request finished from now on, in order."""
    seen: list[int] = []
    on_outputs = srv.state.engine.on_outputs

    def spy(outputs):
        seen.extend(o.num_cached_tokens for o in outputs if o.finished)
        on_outputs(outputs)

    monkeypatch.setattr(srv.state.engine, "on_outputs", spy)
    return seen


def test_each_key_gets_its_own_prefix_cache(serve, monkeypatch):
    srv = serve(api_key=list(KEYS))
    cached = _cached_tokens(srv, monkeypatch)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    for key, extra in ((KEYS[0], {}), (KEYS[0], {}), (KEYS[1], {}), (KEYS[1], {}), (KEYS[0], {"cache_salt": "x"})):
        resp = httpx.post(f"{srv.url}/v1/completions", json={**body, **extra}, headers=_auth(key), timeout=30)
        assert resp.status_code == 200, resp.text
    assert cached == [0, 32, 0, 32, 0]  # b does not hit a's blocks; a request's own salt separates it further


def test_one_key_shares_its_cache_and_salting_can_be_turned_off(serve, monkeypatch):
    srv = serve(api_key=list(KEYS), cache_salt_per_key=False)
    cached = _cached_tokens(srv, monkeypatch)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    for key in KEYS:
        assert httpx.post(f"{srv.url}/v1/completions", json=body, headers=_auth(key), timeout=30).status_code == 200
    assert cached == [0, 32]


def _scheduled(srv, monkeypatch) -> list:
    """(tenant, priority) of every sequence in the order it is first scheduled."""
    order: list = []
    processor = srv.state.engine.engine.output_processor
    mark = processor.mark_scheduled

    def spy(seqs):
        order.extend((s.tenant, s.priority) for s in seqs if processor._by_seq[s.seq_id].first_scheduled_time is None)
        mark(seqs)

    monkeypatch.setattr(processor, "mark_scheduled", spy)
    return order


def _post_later(srv, body: dict, key: str | None, codes: list[int]) -> threading.Thread:
    headers = _auth(key) if key else {}
    thread = threading.Thread(
        target=lambda: codes.append(httpx.post(f"{srv.url}/v1/completions", json=body, headers=headers, timeout=120)
                                    .status_code)
    )  # fmt: skip
    thread.start()
    return thread


def test_a_flood_from_one_key_delays_another_keys_request_by_one_admission(serve, monkeypatch):
    srv = serve(engine={"max_num_seqs": 2}, api_key=list(KEYS))
    order = _scheduled(srv, monkeypatch)
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": 4, "ignore_eos": True}
    codes: list[int] = []
    srv.state.engine.pause()
    threads = [_post_later(srv, body, KEYS[0], codes) for _ in range(12)]
    assert wait_for(lambda: srv.state.engine.engine.scheduler.num_waiting == 12)
    threads.append(_post_later(srv, body, KEYS[1], codes))
    assert wait_for(lambda: srv.state.engine.engine.scheduler.num_waiting == 13)
    srv.state.engine.resume()
    for t in threads:
        t.join(120)
    assert codes == [200] * 13
    assert [tenant for tenant, _ in order].index("key-2") <= 1, order  # after at most one of key-1's requests


def test_priority_orders_requests_and_metrics_report_queue_time_per_priority(serve, monkeypatch):
    srv = serve(engine={"max_num_seqs": 1})
    order = _scheduled(srv, monkeypatch)
    codes: list[int] = []
    srv.state.engine.pause()
    threads = []
    for n, priority in enumerate((5, 0, -1, 0), start=1):
        body = {"model": MODEL, "prompt": "the a", "max_tokens": 2, "priority": priority}
        threads.append(_post_later(srv, body, None, codes))
        assert wait_for(lambda n=n: srv.state.engine.engine.scheduler.num_waiting == n)
    srv.state.engine.resume()
    for t in threads:
        t.join(120)
    assert codes == [200] * 4 and [p for _, p in order] == [-1, 0, 0, 5]
    text = httpx.get(f"{srv.url}/metrics").text
    for priority, count in (("-1", 1), ("0", 2), ("5", 1)):
        name = f'vllm:request_queue_time_seconds_count{{model_name="{MODEL}",priority="{priority}"}}'
        assert metric(text, name) == count


def test_a_full_server_makes_room_for_a_key_holding_fewer(serve):
    srv = serve(engine={"max_num_seqs": 1}, max_queue=2, api_key=list(KEYS))
    body = {"model": MODEL, "prompt": "the a", "max_tokens": 2}
    codes_a: list[int] = []
    codes_b: list[int] = []
    srv.state.engine.pause()
    threads = [_post_later(srv, body, KEYS[0], codes_a) for _ in range(3)]
    assert wait_for(lambda: srv.state.engine.num_in_flight == 3)
    threads.append(_post_later(srv, body, KEYS[1], codes_b))  # full: the newest of key a's makes room
    assert wait_for(lambda: codes_a == [429])
    refused = httpx.post(f"{srv.url}/v1/completions", json=body, headers=_auth(KEYS[0]))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"  # a holds the most
    srv.state.engine.resume()
    for t in threads:
        t.join(120)
    assert sorted(codes_a) == [200, 200, 429] and codes_b == [200]
    assert (
        metric(httpx.get(f"{srv.url}/metrics", headers=_auth(KEYS[0])).text, "quantkit_requests_pushed_out_total") == 1
    )
