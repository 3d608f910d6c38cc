"""Serving smoke test: start the server on a free loopback port, send completion, chat and streaming requests,
check they are well formed and that greedy output equals the offline engine's (``quantkit.LLM``), stop it.

``run_smoke(model, prompts=None, max_tokens=SMOKE_MAX_TOKENS) -> SmokeReport`` is the contract other tools rely
on. A model that cannot be loaded raises ``QuantkitError``; every other problem is a line in
``SmokeReport.failures``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = ["The capital of France is", "Once upon a time, there was"]
SMOKE_MAX_TOKENS = 16  # completion tokens per request (the CLI's and the recipes' default too)
_MODEL_NAME = "smoke"
_TIMEOUT_S = 120.0  # per request


@dataclass(slots=True)
class SmokeReport:
    ok: bool
    failures: list[str]
    requests: int  # HTTP requests sent
    seconds: float  # whole smoke test, loading included
    latency_p50_s: float = 0.0  # generation requests
    latency_max_s: float = 0.0
    ttft_mean_s: float = 0.0  # streaming requests: request sent -> first text chunk
    tokens_per_s: float = 0.0  # completion tokens / time spent in generation requests (sequential)
    completion_tokens: int = 0
    outputs: dict[str, str] = field(default_factory=dict)  # "completion:<prompt>" / "chat:<prompt>" -> text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Tally:
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
        return ok


def run_smoke(model: str | Path, prompts: list[str] | None = None, max_tokens: int = SMOKE_MAX_TOKENS) -> SmokeReport:
    import httpx

    from quantkit.server import ServeConfig, ServerThread, create_app
    from quantkit.server.tokenizing import chat_prompt_ids

    start = time.perf_counter()
    prompts = list(prompts or DEFAULT_PROMPTS)
    tally = _Tally()
    served: dict[str, str] = {}
    app = create_app(model, ServeConfig(port=0, served_model_name=_MODEL_NAME))
    tokenizer = app.state.server.engine.engine.tokenizer
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=_TIMEOUT_S) as client:
        tally.requests += 2
        tally.check(client.get("/health").status_code == 200, "GET /health did not return 200")
        listed = client.get("/v1/models")
        tally.check(listed.status_code == 200 and listed.json()["data"][0]["id"] == _MODEL_NAME, "bad /v1/models")
        for prompt in prompts:
            body = {"model": _MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            text = _completion(client, tally, body, chat=False)
            served[f"completion:{prompt}"] = text if text is not None else ""
            streamed = _stream(client, tally, {**body, "stream": True}, chat=False)
            tally.check(streamed is None or streamed == text, f"streamed text differs for {prompt!r}")
            chat = {"model": _MODEL_NAME, "messages": [{"role": "user", "content": prompt}]}
            chat |= {"max_tokens": max_tokens, "temperature": 0}
            reply = _completion(client, tally, chat, chat=True)
            served[f"chat:{prompt}"] = reply if reply is not None else ""
            streamed = _stream(client, tally, {**chat, "stream": True}, chat=True)
            tally.check(streamed is None or streamed == reply, f"streamed chat reply differs for {prompt!r}")
    del app, server
    _compare_offline(model, prompts, max_tokens, served, tally, tokenizer, chat_prompt_ids)
    busy = sum(tally.latencies)
    return SmokeReport(
        ok=not tally.failures,
        failures=tally.failures,
        requests=tally.requests,
        seconds=time.perf_counter() - start,
        latency_p50_s=statistics.median(tally.latencies) if tally.latencies else 0.0,
        latency_max_s=max(tally.latencies, default=0.0),
        ttft_mean_s=statistics.fmean(tally.ttfts) if tally.ttfts else 0.0,
        tokens_per_s=tally.tokens / busy if busy > 0 else 0.0,
        completion_tokens=tally.tokens,
        outputs=served,
    )


def _completion(client: Any, tally: _Tally, body: dict[str, Any], chat: bool) -> str | None:
    route = "/v1/chat/completions" if chat else "/v1/completions"
    tally.requests += 1
    t0 = time.perf_counter()
    try:
        resp = client.post(route, json=body)
    except Exception as exc:
        tally.check(False, f"POST {route} failed: {type(exc).__name__}: {exc}")
        return None
    tally.latencies.append(time.perf_counter() - t0)
    if not tally.check(resp.status_code == 200, f"POST {route} returned {resp.status_code}: {resp.text[:200]}"):
        return None
    data = resp.json()
    kind = "chat.completion" if chat else "text_completion"
    try:
        choice, usage = data["choices"][0], data["usage"]
        text = choice["message"]["content"] if chat else choice["text"]
        well_formed = (
            data["object"] == kind
            and data["model"] == _MODEL_NAME
            and isinstance(data["id"], str)
            and isinstance(text, str)
            and choice["finish_reason"] in ("stop", "length")
            and 0 < usage["completion_tokens"] <= body["max_tokens"]
            and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        )
    except (KeyError, IndexError, TypeError):
        well_formed, text = False, None
    if not tally.check(well_formed, f"POST {route} response is malformed: {json.dumps(data)[:300]}"):
        return None
    tally.tokens += usage["completion_tokens"]
    return text


def _stream(client: Any, tally: _Tally, body: dict[str, Any], chat: bool) -> str | None:
    """The concatenated streamed text; None (and a failure) when the framing is wrong."""
    route = "/v1/chat/completions" if chat else "/v1/completions"
    tally.requests += 1
    t0 = time.perf_counter()
    pieces: list[str] = []
    events: list[str] = []
    first: float | None = None
    try:
        with client.stream("POST", route, json={**body, "stream_options": {"include_usage": True}}) as resp:
            if not tally.check(resp.status_code == 200, f"streaming {route} returned {resp.status_code}"):
                return None
            for line in resp.iter_lines():
                if not line:
                    continue
                if not tally.check(line.startswith("data: "), f"streaming {route}: bad line {line[:100]!r}"):
                    return None
                events.append(line[6:])
                if events[-1] == "[DONE]":
                    continue
                data = json.loads(events[-1])
                tally.tokens += (data.get("usage") or {}).get("completion_tokens", 0)
                choices = data["choices"]
                piece = (choices[0]["delta"].get("content") if chat else choices[0]["text"]) if choices else None
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    pieces.append(piece)
    except (Exception, json.JSONDecodeError) as exc:
        tally.check(False, f"streaming {route} failed: {type(exc).__name__}: {exc}")
        return None
    tally.latencies.append(time.perf_counter() - t0)
    if first is not None:
        tally.ttfts.append(first)
    if not tally.check(events[-1:] == ["[DONE]"] and events.count("[DONE]") == 1, f"{route} stream lacks [DONE]"):
        return None
    return "".join(pieces)


def _compare_offline(
    model: str | Path,
    prompts: list[str],
    max_tokens: int,
    served: dict[str, str],
    tally: _Tally,
    tokenizer: Any,
    chat_prompt_ids: Any,
) -> None:
    from quantkit.runtime.llm import LLM
    from quantkit.runtime.sampling_params import SamplingParams

    llm = LLM(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    chats = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    offline = llm.generate([*prompts, *chats], greedy)
    for i, prompt in enumerate(prompts):
        for kind, out in (("completion", offline[i]), ("chat", offline[len(prompts) + i])):
            got = served[f"{kind}:{prompt}"]
            tally.check(got == out.text, f"{kind} for {prompt!r}: server {got!r} != offline {out.text!r}")
