"""Issue #39 item 1: extreme sampling values (top_k 2**63, temperature 1e-300) are served, and a request that cannot
be sampled fails alone: every request sharing its engine step, greedy ones included, is answered as if alone."""

from __future__ import annotations

import threading

import httpx

from server.support import MODEL

GREEDY = {"model": MODEL, "prompt": "the a of", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    replies: list[httpx.Response | None] = [None] * len(bodies)

    def post(i: int) -> None:
        replies[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=60)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return replies  # type: ignore[return-value]


def test_extreme_sampling_values_are_served_and_fail_no_other_request(serve):
    srv = serve()
    alone = httpx.post(f"{srv.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    extreme = [
        {**GREEDY, "temperature": 1.0, "top_k": 2**63, "seed": 1},  # overflowed the int64 top-k tensor
        {**GREEDY, "temperature": 1e-300},  # 0 in float32: a division by zero, NaN into multinomial
        {**GREEDY, "temperature": 1e-30, "top_p": 1e-9, "top_k": 2**31, "seed": 2**64 - 1},
    ]
    srv.state.engine.pause()  # all of them land in one engine step with the greedy request
    replies = []
    waiter = threading.Thread(target=lambda: replies.extend(_post_all(srv.url, [GREEDY, *extreme])))
    waiter.start()
    assert _wait_in_flight(srv, 4)
    srv.state.engine.resume()
    waiter.join(60)
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    texts = [r.json()["choices"][0]["text"] for r in replies]
    assert texts[0] == alone  # batched with the extreme ones, the greedy request is unchanged
    assert texts[2] == alone and texts[3] == alone  # a temperature below 1e-5 is greedy
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies)


def _wait_in_flight(srv, n: int) -> bool:
    from server.support import wait_for

    return wait_for(lambda: srv.state.engine.num_in_flight == n and srv.state.engine.engine.scheduler.num_waiting == n)
