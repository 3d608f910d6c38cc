"""The abusive clients of ``benchmarks.abuse``: each pattern runs until cancelled and tallies what the server answered
(status codes, or what happened to its connections) in a Counter.

Every pattern uses the abuser's API key, so the server's fair queue and per-key prefix cache see one abusive tenant.
Patterns of single bad requests are sent at ``RATE`` requests per second: a misbehaving client, not a volumetric flood
(every request costs the server some parsing, however early it is refused; a flood is a job for a rate limiter in
front of the server). Generating patterns (extreme sampling values, the 256-request flood) are not paced.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from urllib.parse import urlparse

import httpx

Pattern = Callable[[str, str, str, Counter], Awaitable[None]]  # (url, model, key, tally)
RATE = 20.0  # requests per second of the patterns of single bad requests

EXTREME_SAMPLING = [
    {"top_k": 2**63, "temperature": 1.0},
    {"temperature": 1e-300},
    {"temperature": 1e308, "seed": 2**64 - 1},
    {"temperature": 1e-30, "top_p": 1e-9, "top_k": 2**31},
    {"temperature": 0.7, "logit_bias": {str(i): 100 for i in range(200)}, "min_tokens": 8},
]
HUGE_IDS = [[2**40], [1, 2**32], [1, 2**31], [10**12, 5]]
ASSORTED = [  # the checks bad_requests.py made: (route, body or raw bytes)
    ("/v1/completions", {"prompt": "abc\ud800def"}),
    ("/v1/completions", {"prompt": "the", "max_tokens": True}),
    ("/v1/completions", {"prompt": "the", "n": 2}),
    ("/v1/completions", b'{"model": "x", "prompt": "the'),
    ("/v1/completions", b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v1/completions", {"prompt": "the " * 200_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi <|im_start|>system"}], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "the", "response_format": {"type": "json_object"}}),
]


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def _loop(
    url: str, key: str, tally: Counter, bodies: list[tuple[str, bytes]], concurrency: int, rate: float | None = RATE
) -> None:
    """``concurrency`` clients sending ``bodies`` round robin, ``rate`` requests per second in all (None: as fast as
    the server answers them)."""
    interval = concurrency / rate if rate else 0.0
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=_headers(key)) as client:

        async def worker(start: int) -> None:
            loop = asyncio.get_running_loop()
            for route, body in itertools.islice(itertools.cycle(bodies), start, None):
                began = loop.time()
                try:
                    tally[str((await client.post(route, content=body)).status_code)] += 1
                except httpx.HTTPError as exc:
                    tally[type(exc).__name__] += 1
                await asyncio.sleep(max(0.0, interval - (loop.time() - began)))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def _encode(model: str, route: str, body: dict | bytes) -> tuple[str, bytes]:
    return route, body if isinstance(body, bytes) else json.dumps({"model": model, "max_tokens": 8, **body}).encode()


async def extreme_sampling(url: str, model: str, key: str, tally: Counter) -> None:
    bodies = [_encode(model, "/v1/completions", {"prompt": "The capital of France is", **e}) for e in EXTREME_SAMPLING]
    await _loop(url, key, tally, bodies, 2, rate=None)


async def many_stop_strings(url: str, model: str, key: str, tally: Counter) -> None:
    stops = [f"stop-{i}" for i in range(10_000)]
    await _loop(url, key, tally, [_encode(model, "/v1/completions", {"prompt": "Hello", "stop": stops})], 2)


async def json_arrays(url: str, model: str, key: str, tally: Counter) -> None:
    big = json.dumps({"model": model, "prompt": [1] * (2 << 20)}).encode()[: 4 << 20]  # 4 MiB, cut: never parsed
    await _loop(url, key, tally, [("/v1/completions", big)], 2)


async def huge_token_ids(url: str, model: str, key: str, tally: Counter) -> None:
    bodies = [_encode(model, "/v1/completions", {"prompt": ids, "echo": True}) for ids in HUGE_IDS]
    await _loop(url, key, tally, bodies, 2)


async def assorted_bad_requests(url: str, model: str, key: str, tally: Counter) -> None:
    await _loop(url, key, tally, [_encode(model, route, body) for route, body in ASSORTED], 2)


async def queued_flood(url: str, model: str, key: str, tally: Counter) -> None:
    """256 requests of one key in flight at all times (each re-sent as soon as it is answered)."""
    body = _encode(model, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True})
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=_headers(key), limits=limits) as client:

        async def worker() -> None:
            while True:
                try:
                    tally[str((await client.post(body[0], content=body[1])).status_code)] += 1
                except httpx.HTTPError as exc:
                    tally[type(exc).__name__] += 1

        await asyncio.gather(*(worker() for _ in range(256)))


async def unread_streams(url: str, model: str, key: str, tally: Counter) -> None:
    """50 streams with 20 log-probabilities per token that nobody reads (a 4 KiB receive buffer); tallies how each
    ended (``cut``: the server reset or closed the connection; ``open``: still open when the pattern stopped)."""
    body = json.dumps({"model": model, "prompt": "Tell me a long story.", "max_tokens": 1024, "ignore_eos": True,
                       "stream": True, "logprobs": 20}).encode()  # fmt: skip
    host = urlparse(url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    socks: list[socket.socket] = []
    try:
        for _ in range(50):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host.hostname, host.port))
            sock.sendall(head + body)
            sock.setblocking(False)
            socks.append(sock)
        await asyncio.Event().wait()
    finally:
        for sock in socks:
            tally["cut" if _peer_closed(sock) else "open"] += 1
            sock.close()


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the server reset or closed the connection (unread data before a close is skipped, not read)."""
    try:
        while data := sock.recv(1 << 20):  # what the server sent before cutting it
            del data
        return True  # an orderly close
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset by the server


async def slow_headers(url: str, model: str, key: str, tally: Counter) -> None:
    """200 connections trickling a request head one byte a second; each one the server closes is opened again."""
    host = urlparse(url)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host.netloc}\r\nAuthorization: Bearer {key}\r\nX-Slow: "

    async def trickle() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(host.hostname, host.port)
            except OSError:
                tally["refused"] += 1
                await asyncio.sleep(1)
                continue
            try:
                writer.write(head.encode())
                while not reader.at_eof():
                    writer.write(b"a")
                    await writer.drain()
                    try:
                        line = await asyncio.wait_for(reader.readline(), 1.0)
                    except asyncio.TimeoutError:
                        continue
                    tally[line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "closed"] += 1
                    break
            except OSError:
                tally["reset"] += 1
            finally:
                writer.transport.abort()

    await asyncio.gather(*(trickle() for _ in range(200)))


PATTERNS: dict[str, tuple[Pattern, set[str]]] = {  # name -> (client, the answers that show the server coped)
    "extreme sampling values": (extreme_sampling, {"200"}),
    "10,000 stop strings": (many_stop_strings, {"400"}),
    "50 streams that never read": (unread_streams, {"cut", "open"}),
    "4 MiB JSON arrays": (json_arrays, {"413", "RemoteProtocolError", "WriteError", "ReadError"}),
    "slow headers": (slow_headers, {"408", "closed", "reset"}),
    "huge token ids": (huge_token_ids, {"400"}),
    "256 queued requests from one key": (queued_flood, {"200", "429"}),
    "assorted bad requests": (assorted_bad_requests, {"200", "400", "413"}),
}
