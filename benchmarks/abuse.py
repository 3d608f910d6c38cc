"""Abuse benchmark: while well-behaved clients stream, each abusive pattern runs for a while; the well-behaved
clients must lose no request, keep their throughput, and the server's memory must stay bounded.

    python -m benchmarks.abuse                      # smollm2-135m, 32 clients, 20 s per phase (a few minutes)
    python -m benchmarks.abuse --seconds 3 --clients 8 --json abuse.json   # a quick look

It starts `quantkit serve` with one API key per well-behaved client and one for the abuser (a server shared by many
users, one of them hostile). Each pattern of ``benchmarks.abuse_patterns`` (extreme sampling values, 10,000 stop
strings, 50 streams that never read, 4 MiB JSON arrays, slow headers, huge token ids, 256 queued requests from one key,
assorted bad requests) runs between two clean phases; a few seconds after each phase are not measured.

A phase passes when every well-behaved request that ended in it is a 200 with all its tokens, their throughput
(streamed tokens per second, counted as they arrive) is at least ``--min-ratio`` of the clean phases around it, the
server's RSS stays below the RSS of the first clean phase plus ``--rss-margin-mb``, and the abuser met only the answers
listed for its pattern (never a 500). The ratio needs a quiet machine: other processes on the CPUs make it
indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.abuse_patterns import PATTERNS
from benchmarks.load_test import PROMPTS, start_server

NAME = "model"
ABUSER = "abuser-key"
CLEAN = "clean"


@dataclass(slots=True)
class Done:
    end: float
    ok: bool
    tokens: int
    why: str = ""


@dataclass(slots=True)
class Phase:
    name: str
    start: float = 0.0
    end: float = 0.0
    requests: int = 0
    lost: int = 0
    lost_why: dict[str, int] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    ratio: float = 0.0
    rss_peak_mb: float = 0.0
    abuser: dict[str, int] = field(default_factory=dict)
    unexpected: dict[str, int] = field(default_factory=dict)
    ok: bool = False


async def _good_client(url: str, key: str, i: int, max_tokens: int, log: list[Done], ticks: list[float]) -> None:
    """Streams completions back to back; ``ticks``: the time of every streamed text chunk (about one per token)."""
    body = {"model": NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    await asyncio.sleep(0.1 * i)  # staggered: clients that start together finish together, every request
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        for n in range(sys.maxsize):
            tokens, done, why = 0, False, ""
            try:
                prompt = f"{PROMPTS[(i + n) % len(PROMPTS)]} (user {i}, request {n})"
                async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as resp:
                    why = str(resp.status_code)
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            data = json.loads(line[6:])
                            why = "error event" if "error" in data else why
                            tokens += (data.get("usage") or {}).get("completion_tokens", 0)
                            if data.get("choices") and data["choices"][0].get("text"):
                                ticks.append(time.monotonic())
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                why = type(exc).__name__
            ok = done and why == "200" and tokens == max_tokens
            log.append(Done(time.monotonic(), ok, tokens if ok else 0, "" if ok else why or "incomplete"))


async def _watch_rss(url: str, key: str, samples: list[tuple[float, float]]) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        while True:
            try:
                text = (await client.get("/metrics")).text
                match = re.search(r"^process_resident_memory_bytes (\S+)", text, re.M)
                if match:
                    samples.append((time.monotonic(), float(match.group(1)) / 2**20))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)


async def _run(url: str, args: argparse.Namespace, keys: list[str]) -> list[Phase]:
    log: list[Done] = []
    ticks: list[float] = []
    rss: list[tuple[float, float]] = []
    background = [asyncio.create_task(_good_client(url, k, i, args.max_tokens, log, ticks)) for i, k in enumerate(keys)]
    background.append(asyncio.create_task(_watch_rss(url, keys[0], rss)))
    names = [n for n in PATTERNS if not args.patterns or n in args.patterns]
    phases = [Phase(CLEAN)]
    for name in names:  # each pattern between two clean phases: its baseline drifts with the machine's load
        phases += [Phase(name), Phase(CLEAN)]
    await asyncio.sleep(args.settle + 0.1 * len(keys))  # warm-up: every client has a request in flight
    for phase in phases:
        tally: Counter = Counter()
        task = asyncio.create_task(PATTERNS[phase.name][0](url, NAME, ABUSER, tally)) if phase.name != CLEAN else None
        phase.start = time.monotonic()
        await asyncio.sleep(args.seconds if task is not None else args.clean_seconds)
        phase.end = time.monotonic()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        phase.abuser = dict(tally)
        print(f"{phase.name}: {dict(tally)}", flush=True)
        await asyncio.sleep(args.settle)  # what the pattern left behind drains, unmeasured
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    _score(phases, log, ticks, rss, args)
    return phases


def _score(
    phases: list[Phase], log: list[Done], ticks: list[float], rss: list[tuple[float, float]], args: argparse.Namespace
) -> None:
    for phase in phases:
        ended = [d for d in log if phase.start <= d.end < phase.end]
        phase.requests, phase.lost = len(ended), sum(not d.ok for d in ended)
        phase.lost_why = dict(Counter(d.why for d in ended if not d.ok))
        phase.tokens_per_s = sum(phase.start <= t < phase.end for t in ticks) / (phase.end - phase.start)
        phase.rss_peak_mb = max((r for t, r in rss if phase.start <= t < phase.end), default=0.0)
        expected = PATTERNS[phase.name][1] if phase.name != CLEAN else set()
        phase.unexpected = {k: v for k, v in phase.abuser.items() if k not in expected}
    clean = statistics.fmean(p.tokens_per_s for p in phases if p.name == CLEAN)
    bound = phases[0].rss_peak_mb + args.rss_margin_mb
    for i, phase in enumerate(phases):
        around = [p.tokens_per_s for p in phases[max(0, i - 1) : i + 2] if p.name == CLEAN and p is not phase]
        reference = statistics.fmean(around) if around else clean
        phase.ratio = phase.tokens_per_s / reference if reference else 0.0
        kept = phase.name == CLEAN or phase.ratio >= args.min_ratio  # clean phases are the reference
        phase.ok = phase.lost == 0 and kept and phase.rss_peak_mb <= bound and not phase.unexpected


def _table(phases: list[Phase], result: dict) -> Table:
    table = Table(title=f"{result['clients']} well-behaved streaming clients, {result['seconds']:g} s per phase "
                  f"(RSS bound {result['rss_bound_mb']:.0f} MB)")  # fmt: skip
    for column in ("phase", "requests", "lost", "tokens/s", "x clean", "RSS peak MB", "abuser got", "ok"):
        table.add_column(column, justify="left" if column in ("phase", "abuser got") else "right")
    for p in phases:
        got = ", ".join(f"{k}: {v}" for k, v in sorted(p.abuser.items())) or "-"
        table.add_row(p.name, str(p.requests), str(p.lost) + (f" {p.lost_why}" if p.lost else ""),
                      f"{p.tokens_per_s:.1f}", f"{p.ratio:.2f}", f"{p.rss_peak_mb:.0f}", got,
                      "yes" if p.ok else "NO")  # fmt: skip
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, default=32, help="well-behaved streaming clients, one API key each")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each abusive phase")
    parser.add_argument("--clean-seconds", type=float, default=10.0, help="length of each clean phase")
    parser.add_argument("--settle", type=float, default=5.0, help="unmeasured seconds before each phase")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="mean completion tokens per well-behaved request (+-8 by client)"
    )
    parser.add_argument("--min-ratio", type=float, default=0.8, help="throughput kept, against the clean phases")
    parser.add_argument("--rss-margin-mb", type=float, default=256.0, help="RSS allowed above the first clean phase")
    parser.add_argument("--patterns", nargs="*", default=None, help=f"a subset of: {', '.join(PATTERNS)}")
    parser.add_argument("--server-args", default="", help="extra `quantkit serve` options")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    keys = [f"user-key-{i}" for i in range(args.clients)]
    extra = [a for k in [*keys, ABUSER] for a in ("--api-key", k)] + args.server_args.split()
    started = time.monotonic()
    proc, url = start_server(args.model, NAME, extra)
    try:
        phases = asyncio.run(_run(url, args, keys))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    result = {"model": args.model, "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
              "rss_bound_mb": phases[0].rss_peak_mb + args.rss_margin_mb, "min_ratio": args.min_ratio,
              "wall_s": round(time.monotonic() - started, 1), "phases": [asdict(p) for p in phases]}  # fmt: skip
    Console(width=160).print(_table(phases, result))
    print(f"took {result['wall_s']:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(p.ok for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
