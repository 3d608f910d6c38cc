"""Issue #39 item 2: a streaming client that never reads. Its request keeps only the latest (cumulative) output, not
one per step; once the client has read nothing for --write-timeout seconds the connection is cut, the request
aborted, its slot and KV blocks freed, and the cut counted in /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from quantkit.runtime.engine import Engine
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.server.async_engine import AsyncEngine
from server.support import MODEL, idle, metric, raw_request, read_all, wait_for

LONG = {"model": MODEL, "prompt": "the a of", "max_tokens": 1900, "ignore_eos": True, "stream": True, "logprobs": 5}


def test_a_request_nobody_reads_keeps_one_output(long_model_dir):
    """The engine runs 40 steps while nobody reads: the reader then finds one output holding all 40 tokens (the
    per-request queue used to hold all 40, each with a fresh copy of everything before it)."""

    async def scenario() -> list[int]:
        eng = AsyncEngine(Engine(long_model_dir, num_kv_blocks=64), max_queue=4)
        eng.start()
        try:
            rid = eng.reserve()
            await eng.submit(rid, [1, 5, 6], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            deadline = time.monotonic() + 30
            while eng.num_in_flight and time.monotonic() < deadline:  # the slot is freed when the engine is done
                await asyncio.sleep(0.02)
            return [len(out.token_ids) async for out in eng.outputs(rid)]
        finally:
            eng.stop()

    assert asyncio.run(scenario()) == [40]


def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(serve):
    srv = serve(write_timeout=1.0)
    sock = raw_request(srv, LONG)
    try:
        assert sock.recv(64).startswith(b"HTTP/1.1 200"), "the stream did not start"
        started = time.monotonic()
        assert wait_for(lambda: idle(srv), timeout=60), "the unread stream kept its request"
        assert time.monotonic() - started < 45
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "quantkit_write_timeouts_total") == 1
        assert metric(text, "vllm:generation_tokens_total") < LONG["max_tokens"]  # aborted, not run to the end
        assert metric(text, "quantkit_num_requests_in_flight") == 0
        read_all(sock, timeout=5)  # the connection was reset: reading ends
    finally:
        sock.close()
    body = {"model": MODEL, "prompt": "the", "max_tokens": 2}
    assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).status_code == 200


@pytest.mark.slow
def test_unread_streams_do_not_grow_server_memory(tmp_path):
    """A real `quantkit serve` (defaults) and 3 streams of up to 7,000 tokens with 20 log-probabilities each that
    nobody reads: the server's RSS grows by less than 150 MB and every stream is cut within its write timeout."""
    from helpers.tiny import save_tiny_model

    from server.support import start_cli_server

    model = save_tiny_model(tmp_path / "model", max_position_embeddings=8192)
    proc, url = start_cli_server(model, ["--num-kv-blocks", "2048", "--max-model-len", "8192"])
    try:
        before = metric(httpx.get(f"{url}/metrics").text, "process_resident_memory_bytes")
        body = {**LONG, "max_tokens": 7000, "logprobs": 20, "return_tokens_as_token_ids": True}
        socks = [raw_request(url, body) for _ in range(3)]
        peak, deadline = before, time.monotonic() + 120
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics").text
            peak = max(peak, metric(text, "process_resident_memory_bytes"))
            if metric(text, "quantkit_num_requests_in_flight") == 0:
                break
            time.sleep(0.5)
        assert peak - before < 150e6, f"RSS grew by {(peak - before) / 1e6:.0f} MB"
        assert metric(text, "quantkit_num_requests_in_flight") == 0, "unread streams kept their slots"
        assert metric(text, "quantkit_write_timeouts_total") == 3
        for sock in socks:
            sock.close()
    finally:
        proc.terminate()
        proc.wait(60)
