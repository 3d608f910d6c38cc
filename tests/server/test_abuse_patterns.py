"""The abusive clients of `python -m benchmarks.abuse`, each for a moment against a tiny server with two API keys: the
server answers each with what the pattern expects (never a 500), stays healthy, and serves a normal request after."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from benchmarks.abuse_patterns import PATTERNS
from server.support import MODEL, wait_for

KEYS = ["user-key", "abuser-key"]
# A legitimate client on a loaded machine can take more than half a second between opening a connection and sending
# its head: a header timeout that short cut the queued flood's connections (ReadError). The timeout stays short enough
# that the slow-headers pattern, run for longer than it, still meets it.
HEADER_TIMEOUT = 1.5
RUN_SECONDS = {"slow headers": 2 * HEADER_TIMEOUT + 1.0}


@pytest.mark.slow
def test_every_abuse_pattern_gets_the_answers_it_expects(serve):
    srv = serve(api_key=KEYS, header_timeout=HEADER_TIMEOUT, write_timeout=1.0)
    results: dict[str, Counter] = {}

    async def run(pattern, tally: Counter, seconds: float) -> None:
        task = asyncio.create_task(pattern(srv.url, MODEL, KEYS[1], tally))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    for name, (pattern, _) in PATTERNS.items():
        results[name] = Counter()
        asyncio.run(run(pattern, results[name], RUN_SECONDS.get(name, 2.0)))
        # each pattern starts on an idle server: the previous one's requests are finished or aborted
        assert wait_for(lambda: srv.state.engine.num_in_flight == 0, timeout=30), f"{name}: requests left running"
    for name, (_, expected) in PATTERNS.items():
        assert results[name], f"{name}: no answer at all"
        assert set(results[name]) <= expected, f"{name}: {dict(results[name])}"
    assert results["slow headers"]["408"] > 0  # cut at the header timeout
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    assert wait_for(lambda: srv.state.engine.num_in_flight == 0, timeout=30)
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    body = {"model": MODEL, "prompt": "the a", "max_tokens": 2}
    assert httpx.post(f"{srv.url}/v1/completions", json=body, headers=auth, timeout=30).status_code == 200
