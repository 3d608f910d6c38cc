"""Hostile-client check: every kind of bad request is answered 4xx quickly while a normal request keeps its pace.

    python -m benchmarks.bad_requests --model smollm2-135m --json bad-requests.json   # starts `quantkit serve`

First the unloaded latency of a normal greedy completion (median of --repeat). Then, for each bad request kind,
--burst copies of it are sent at once while a normal completion runs; the table gives the status codes, the
slowest answer, and the normal request's latency against the unloaded one. A slow body (slow-loris) is answered
408 at the server's --body-timeout by design; every other bad kind must be answered within --limit seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.load_test import start_server

API_KEY = "bad-requests-key"
NAME = "model"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
NORMAL = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0, "ignore_eos": True}


def _body(**fields: object) -> bytes:
    return json.dumps({"model": NAME, "prompt": "the", **fields}).encode()


def _nested(depth: int) -> bytes:
    return b'{"model": "' + NAME.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


# kind -> (route, headers, body, expected status)
CASES: dict[str, tuple[str, dict[str, str | bytes], bytes, int]] = {
    "20 MB body": ("/v1/completions", AUTH, _body(prompt="the " * 5_000_000), 413),
    "3.9 MB prompt (over the character limit)": ("/v1/completions", AUTH, _body(prompt="the " * 975_000), 400),
    "prompt longer than the context": ("/v1/completions", AUTH, _body(prompt="the " * 12_000), 400),
    "lone surrogate in a prompt": ("/v1/completions", AUTH, _body(prompt="abc\ud800def"), 400),
    "lone surrogate in a chat message": (
        "/v1/chat/completions",
        AUTH,
        json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi \udfff"}]}).encode(),
        400,
    ),
    "max_tokens: true": ("/v1/completions", AUTH, _body(max_tokens=True), 400),
    'stream: "yes"': ("/v1/completions", AUTH, _body(stream="yes"), 400),
    "n: 2": ("/v1/completions", AUTH, _body(n=2), 400),
    "malformed JSON": ("/v1/completions", AUTH, b'{"model": "model", "prompt": "the', 400),
    "JSON nested 100,000 deep": ("/v1/completions", AUTH, _nested(100_000), 400),
    "unknown model": ("/v1/completions", AUTH, _body(model="gpt-4"), 400),
    "wrong API key": ("/v1/completions", {**AUTH, "Authorization": "Bearer nope"}, _body(), 401),
    "non-ASCII API key": ("/v1/completions", {**AUTH, "Authorization": "Bearer clé".encode()}, _body(), 401),
    "lower-case bearer (valid)": (
        "/v1/completions",
        {**AUTH, "Authorization": f"bearer {API_KEY}"},
        _body(max_tokens=1),
        200,
    ),
}
SLOW_BODY = "slow body (slow-loris)"


async def _normal(client: httpx.AsyncClient) -> float:
    start = time.perf_counter()
    resp = await client.post("/v1/completions", json=NORMAL, headers=AUTH)
    resp.raise_for_status()
    return time.perf_counter() - start


async def _bad(
    client: httpx.AsyncClient, route: str, headers: dict[str, str | bytes], body: bytes
) -> tuple[int, float]:
    start = time.perf_counter()
    resp = await client.post(route, content=body, headers=headers)
    return resp.status_code, time.perf_counter() - start


async def _slow_body(url: str) -> tuple[int, float]:
    """Headers promising 1,000 bytes, then 10 bytes and silence until the server answers."""
    parts = urlparse(url)
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")  # fmt: skip
    writer.write(head.encode() + b'{"model": ')
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=120)
    writer.close()
    return int(status_line.split()[1]), time.perf_counter() - start


async def _case(url: str, kind: str, burst: int) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        normal = asyncio.create_task(_normal(client))
        await asyncio.sleep(0.05)  # the normal request is running when the bad ones arrive
        if kind == SLOW_BODY:
            answers = await asyncio.gather(*(_slow_body(url) for _ in range(burst)))
        else:
            route, headers, body, _ = CASES[kind]
            answers = await asyncio.gather(*(_bad(client, route, headers, body) for _ in range(burst)))
        return {"statuses": sorted({s for s, _ in answers}), "slowest_s": max(t for _, t in answers),
                "normal_s": await normal}  # fmt: skip


async def _run(url: str, args: argparse.Namespace) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await _normal(client)  # warm-up
        unloaded = statistics.median([await _normal(client) for _ in range(args.repeat)])
    rows = []
    for kind in [*CASES, SLOW_BODY]:
        trials = [await _case(url, kind, args.burst) for _ in range(args.repeat)]
        expected = 408 if kind == SLOW_BODY else CASES[kind][3]
        statuses = sorted({s for t in trials for s in t["statuses"]})  # type: ignore[attr-defined]
        slowest = max(t["slowest_s"] for t in trials)  # type: ignore[type-var]
        normal = statistics.median(t["normal_s"] for t in trials)  # type: ignore[misc]
        in_time = kind == SLOW_BODY or expected < 400 or slowest < args.limit
        rows.append({"kind": kind, "expected": expected, "statuses": statuses, "slowest_s": round(slowest, 3),
                     "normal_s": round(normal, 3), "normal_ratio": round(normal / unloaded, 2),
                     "ok": statuses == [expected] and in_time and normal < 2 * unloaded})  # fmt: skip
    return {"unloaded_s": round(unloaded, 3), "burst": args.burst, "repeat": args.repeat, "rows": rows}


def _table(result: dict[str, object]) -> Table:
    table = Table(title=f"Bad requests x{result['burst']} during a normal one (unloaded {result['unloaded_s']} s)")
    for column in ("request", "expected", "got", "slowest answer s", "normal request s", "x unloaded", "ok"):
        table.add_column(column, justify="left" if column == "request" else "right")
    for row in result["rows"]:  # type: ignore[attr-defined]
        table.add_row(row["kind"], str(row["expected"]), ",".join(map(str, row["statuses"])),
                      f"{row['slowest_s']:.3f}", f"{row['normal_s']:.3f}", f"{row['normal_ratio']:.2f}",
                      "yes" if row["ok"] else "NO")  # fmt: skip
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--burst", type=int, default=4, help="copies of each bad request sent at once")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--limit", type=float, default=1.0, help="seconds within which a bad request is answered")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    proc, url = start_server(args.model, NAME, ["--api-key", API_KEY])
    try:
        result = asyncio.run(_run(url, args))
    finally:
        proc.terminate()
        proc.wait(60)
    Console(width=140).print(_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(row["ok"] for row in result["rows"]) else 1  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
