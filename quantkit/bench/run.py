"""Drive an :class:`~quantkit.runtime.engine.Engine` through a workload with at most ``concurrency`` requests in
flight (a new one is added as soon as another finishes), recording what ``quantkit bench`` reports."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from quantkit.bench.workload import BenchRequest
from quantkit.runtime.engine import Engine
from quantkit.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestRecord:
    kind: str
    prompt_tokens: int
    tokens: list[int]
    ttft: float  # seconds from the engine's arrival stamp to the first token
    tpot: float | None  # seconds per output token after the first (None: one token)
    latency: float  # arrival to finish
    finish_reason: str


@dataclass(slots=True)
class EngineRun:
    records: list[RequestRecord]  # in workload order
    wall: float  # seconds, first add_request to the last output
    steps: int  # engine steps that ran a batch
    peak_rss: int | None  # bytes: the process's peak resident set up to the end of the run (model load included)
    kv_peak_usage: float  # max fraction of KV blocks in use after a step
    kv_num_blocks: int
    block_size: int
    stage_seconds: dict[str, float]  # the engine's per-stage profile of this run
    speculation: dict[str, float] | None  # SpeculationStats of this run (None: speculation off)
    preemptions: int


def run_engine(
    engine: Engine, requests: list[BenchRequest], concurrency: int | None = None, label_steps: bool = False
) -> EngineRun:
    """Run every request greedily (EOS honoured) to completion; the engine's profile and stats restart here.
    ``label_steps``: each step is a ``record_function("engine.step")`` span (for ``torch.profiler`` traces)."""
    _reset_counters(engine)
    limit = concurrency or len(requests)
    pending = deque(enumerate(requests))
    index: dict[str, int] = {}
    records: list[RequestRecord | None] = [None] * len(requests)
    preempted, kv_peak = engine.num_preemptions, 0.0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(index) < limit:
            i, r = pending.popleft()
            index[engine.add_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens))] = i
        outputs = _step(engine, label_steps)
        kv_peak = max(kv_peak, engine.block_manager.usage)
        for out in outputs:
            if out.finished:
                i = index.pop(out.request_id)
                records[i] = _record(requests[i], out)
    wall = time.perf_counter() - t0
    return EngineRun(
        records=[r for r in records if r is not None],
        wall=wall,
        steps=engine.profile.steps,
        peak_rss=peak_rss_bytes(),
        kv_peak_usage=kv_peak,
        kv_num_blocks=engine.block_manager.num_blocks,
        block_size=engine.config.block_size,
        stage_seconds=dict(engine.profile.seconds),
        speculation=_spec_dict(engine.spec_stats) if engine.config.speculative else None,
        preemptions=engine.num_preemptions - preempted,
    )


def warm_up(engine: Engine) -> None:
    """Two short requests (token ids no workload prompt starts with), so the measured run skips first-call costs."""
    vocab = engine.model.config.vocab_size
    for n in (8, 24):
        prompt = [(7 * i + 3) % vocab for i in range(n)]
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _step(engine: Engine, label: bool) -> list[Any]:
    if not label:
        return engine.step()
    from torch.profiler import record_function

    with record_function("engine.step"):
        return engine.step()


def _record(request: BenchRequest, out: Any) -> RequestRecord:
    first = out.first_token_time if out.first_token_time is not None else out.finish_time
    n = len(out.token_ids)
    return RequestRecord(
        kind=request.kind,
        prompt_tokens=len(request.prompt),
        tokens=list(out.token_ids),
        ttft=first - out.arrival_time,
        tpot=(out.finish_time - first) / (n - 1) if n > 1 else None,
        latency=out.finish_time - out.arrival_time,
        finish_reason=out.finish_reason.value if out.finish_reason is not None else "none",
    )


def _reset_counters(engine: Engine) -> None:
    engine.profile.reset()
    engine.spec_stats.reset()


def _spec_dict(stats: Any) -> dict[str, float]:
    return {
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "verify_steps": stats.verify_steps,
        "emitted": stats.emitted,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_step": stats.tokens_per_step,
    }


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size (``getrusage``; psutil's current RSS where that is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.Process().memory_info().rss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB elsewhere
