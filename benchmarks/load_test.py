"""Concurrency sweep against a quantkit server on loopback: throughput, latency, TTFT, lost requests, RSS.

    python -m benchmarks.load_test --model smollm2-135m             # starts `quantkit serve` itself
    python -m benchmarks.load_test --url http://127.0.0.1:8000 --served-model-name smollm2-135m

Every level sends ``clients * requests_per_client`` streaming completions (bounded in count and time). A
request is "answered" with a status code or "lost" (connection error, timeout, never finished). The sweep runs
``--repeat`` times; the server's RSS (from /metrics) is reported before and after each run (flat memory).
Only loopback addresses are allowed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "The three most important things in life are",
    "In the morning, Elinor walked to",
    "A short poem about the sea:",
]


@dataclass(slots=True)
class Result:
    status: int | None  # None: lost (no status)
    latency: float = 0.0
    ttft: float | None = None
    tokens: int = 0


@dataclass(slots=True)
class Level:
    clients: int
    requests: int
    ok: int = 0
    rejected_429: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    lost: int = 0
    seconds: float = 0.0
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    latency_s: dict[str, float] = field(default_factory=dict)  # p50/p95/p99
    ttft_s: dict[str, float] = field(default_factory=dict)


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


async def _one(client: httpx.AsyncClient, body: dict, timeout: float) -> Result:
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Result(resp.status_code, time.perf_counter() - t0)
            result, done = Result(200), False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                data = json.loads(line[6:])
                if data.get("error"):
                    return Result(500, time.perf_counter() - t0)
                if data["choices"] and data["choices"][0]["text"] and result.ttft is None:
                    result.ttft = time.perf_counter() - t0
                result.tokens += (data.get("usage") or {}).get("completion_tokens", 0)
            result.latency = time.perf_counter() - t0
            return result if done else Result(None)
    except (httpx.HTTPError, json.JSONDecodeError):
        return Result(None)


async def run_level(url: str, model: str, clients: int, per_client: int, max_tokens: int, timeout: float) -> Level:
    level = Level(clients, clients * per_client)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    results: list[Result] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=_HEADERS) as client:

        async def worker(w: int) -> None:
            for i in range(per_client):
                prompt = PROMPTS[(w + i) % len(PROMPTS)] + f" (request {w}.{i})"
                results.append(await _one(client, {**body, "prompt": prompt}, timeout))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(w)) for w in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=timeout * per_client)
        for task in pending:
            task.cancel()
        level.seconds = time.perf_counter() - t0
    level.lost = level.requests - len(results) + sum(r.status is None for r in results)
    level.ok = sum(r.status == 200 for r in results)
    level.rejected_429 = sum(r.status == 429 for r in results)
    level.errors_5xx = sum(r.status is not None and r.status >= 500 for r in results)
    level.errors_4xx = sum(r.status is not None and 400 <= r.status < 500 and r.status != 429 for r in results)
    good = [r for r in results if r.status == 200]
    level.requests_per_s = len(good) / level.seconds
    level.tokens_per_s = sum(r.tokens for r in good) / level.seconds
    level.latency_s = _pcts([r.latency for r in good])
    level.ttft_s = _pcts([r.ttft for r in good if r.ttft is not None])
    return level


_HEADERS: dict[str, str] = {}


def server_rss_mb(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=_HEADERS, timeout=30).text
    match = re.search(r"^process_resident_memory_bytes (\S+)", text, re.M)
    return float(match.group(1)) / 2**20 if match else float("nan")


def start_server(model: str, name: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "quantkit", "serve", model, "--port", "0", "--served-model-name", name, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"at (http://\S+)", line):
                found.append(m.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(300)
    if not found:
        proc.kill()
        sys.exit("the server did not start")
    return proc, found[0]


def print_level(run: int, lv: Level) -> None:
    lat, ttft = lv.latency_s, lv.ttft_s
    print(
        f"run {run} c={lv.clients:>3} n={lv.requests:>4} ok={lv.ok:>4} 429={lv.rejected_429} 4xx={lv.errors_4xx} "
        f"5xx={lv.errors_5xx} lost={lv.lost} | {lv.requests_per_s:6.2f} req/s {lv.tokens_per_s:7.1f} tok/s | "
        f"latency p50/p95/p99 {lat.get('p50', 0):.2f}/{lat.get('p95', 0):.2f}/{lat.get('p99', 0):.2f} s | "
        f"TTFT p50/p95/p99 {ttft.get('p50', 0):.2f}/{ttft.get('p95', 0):.2f}/{ttft.get('p99', 0):.2f} s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="A running server (loopback only).")
    src.add_argument("--model", help="Start `quantkit serve MODEL` on a free loopback port.")
    ap.add_argument("--served-model-name", default="load-test")
    ap.add_argument("--levels", default="1,4,16,32,64", help="Concurrent clients per level.")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="Runs of the whole sweep (memory must stay flat).")
    ap.add_argument("--timeout", type=float, default=120.0, help="Seconds per request at most.")
    ap.add_argument("--api-key")
    ap.add_argument("--server-args", default="", help="Extra `quantkit serve` options, with --model.")
    ap.add_argument("--json", help="Write all figures to this file.")
    args = ap.parse_args()
    if args.api_key:
        _HEADERS["Authorization"] = f"Bearer {args.api_key}"
    proc = None
    if args.model:
        extra = args.server_args.split() + (["--api-key", args.api_key] if args.api_key else [])
        proc, url = start_server(args.model, args.served_model_name, extra)
    else:
        url = args.url.rstrip("/")
        if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("only loopback servers may be load-tested")
    levels = [int(x) for x in args.levels.split(",")]
    report: dict = {"url": url, "levels": levels, "max_tokens": args.max_tokens, "runs": [], "rss_mb": []}
    try:
        report["rss_mb"].append(server_rss_mb(url))
        print(f"server RSS before: {report['rss_mb'][0]:.1f} MB", flush=True)
        for run in range(1, args.repeat + 1):
            levs = []
            for clients in levels:
                lv = asyncio.run(
                    run_level(url, args.served_model_name, clients, args.requests_per_client, args.max_tokens,
                              args.timeout)
                )  # fmt: skip
                print_level(run, lv)
                levs.append(asdict(lv))
            report["runs"].append(levs)
            report["rss_mb"].append(server_rss_mb(url))
            print(f"server RSS after run {run}: {report['rss_mb'][-1]:.1f} MB", flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            report["server_exit_code"] = proc.wait(120)
            print(f"server exit code after SIGTERM: {report['server_exit_code']}")
    all_levels = [lv for run in report["runs"] for lv in run]
    lost, fivexx = sum(lv["lost"] for lv in all_levels), sum(lv["errors_5xx"] for lv in all_levels)
    growth = report["rss_mb"][-1] - report["rss_mb"][1] if len(report["rss_mb"]) > 2 else 0.0
    print(f"lost={lost} 5xx={fivexx} RSS growth between run 1 and run {args.repeat}: {growth:+.1f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    sys.exit(1 if lost or fivexx else 0)


if __name__ == "__main__":
    main()
