"""Prometheus metrics in the text exposition format (no client library needed).

A series that means what one of vLLM's means carries vLLM's name and its ``model_name`` label, so dashboards and
alerts written for vLLM read this server unchanged (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:prompt_tokens_total``, ``vllm:time_to_first_token_seconds``, ...; names as in vLLM's
``vllm/v1/metrics/loggers.py``). Series with no vLLM counterpart keep the ``quantkit_`` prefix.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_MAX_PRIORITY_LABELS = 16  # distinct priorities with a series of their own; the rest share priority="other"

# name -> (type, help, getter): series read when scraped (from the engine's latest stats)
Sampled = dict[str, tuple[str, str, Callable[[], float]]]


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, total = [], 0
        prefix = f"{labels}," if labels else ""
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{prefix}le="{le}"}} {total}')
        suffix = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{suffix} {self.sum}", f"{name}_count{suffix} {total}"]


@dataclass(slots=True)
class Metrics:
    """Updated on the event loop only; gauges are read from the engine's latest stats when scraped."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)  # (route, status code) -> count
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests finished without error
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(_TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(_TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(_E2E_BUCKETS))
    queue_time: dict[str, Histogram] = field(default_factory=dict)  # priority label -> arrival to first scheduled
    request_errors: int = 0  # requests the engine finished with an error
    pushed_out: int = 0  # waiting requests refused (429) to make room for a key holding fewer
    connections_refused: int = 0  # over --max-connections
    header_timeouts: int = 0  # connections closed for not sending a request head within --header-timeout
    write_timeouts: int = 0  # connections cut because their client read nothing for --write-timeout

    def count_request(self, route: str, code: int) -> None:
        self.requests[route, code] = self.requests.get((route, code), 0) + 1

    def count_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Prompt tokens once a request's prefill is done; generated tokens as they come (aborted requests too)."""
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def observe_finished(
        self, reason: str, completion_tokens: int, arrival: float, first: float | None, finish: float | None
    ) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if first is not None:
            self.ttft.observe(first - arrival)
            if finish is not None and completion_tokens > 1:
                self.tpot.observe((finish - first) / (completion_tokens - 1))
        if finish is not None:
            self.e2e.observe(finish - arrival)

    def observe_queue(self, priority: int, seconds: float) -> None:
        label = str(priority)
        if label not in self.queue_time and len(self.queue_time) >= _MAX_PRIORITY_LABELS:
            label = "other"  # a client choosing priorities cannot grow the number of series without bound
        self.queue_time.setdefault(label, Histogram(_QUEUE_BUCKETS)).observe(max(seconds, 0.0))

    def render(self, model_name: str, sampled: Sampled) -> str:
        """``sampled``: name -> (type, help, getter), read now; a ``vllm:`` name gets the ``model_name`` label."""
        model = f'model_name="{_escape(model_name)}"'
        name = "quantkit_requests_total"
        lines = [f"# HELP {name} HTTP requests by route and status code.", _type(name)]
        for (route, code), n in sorted(self.requests.items()):
            lines.append(f'quantkit_requests_total{{route="{_escape(route)}",code="{code}"}} {n}')
        for name, help_, value in (
            ("vllm:prompt_tokens_total", "Prompt tokens of requests whose prefill is done.", self.prompt_tokens),
            ("vllm:generation_tokens_total", "Generated tokens.", self.generation_tokens),
        ):
            lines += [f"# HELP {name} {help_}", _type(name), f"{name}{{{model}}} {value}"]
        for name, help_, value in (
            ("quantkit_request_errors_total", "Requests the engine finished with an error.", self.request_errors),
            ("quantkit_requests_pushed_out_total", "Waiting requests refused (429) to make room for an API key "
             "holding fewer.", self.pushed_out),
            ("quantkit_connections_refused_total", "Connections over --max-connections.", self.connections_refused),
            ("quantkit_header_timeouts_total", "Connections closed for a request head slower than "
             "--header-timeout.", self.header_timeouts),
            ("quantkit_write_timeouts_total", "Connections cut (their request aborted) because the client read "
             "nothing for --write-timeout.", self.write_timeouts),
        ):  # fmt: skip
            lines += [f"# HELP {name} {help_}", _type(name), f"{name} {value}"]
        name = "vllm:request_success_total"
        lines += [f"# HELP {name} Requests finished without error, by finish reason.", _type(name)]
        for reason in sorted({"stop", "length", *self.finished}):
            lines.append(f'{name}{{{model},finished_reason="{_escape(reason)}"}} {self.finished.get(reason, 0)}')
        for name, (kind, help_, get) in sampled.items():
            labels = f"{{{model}}}" if name.startswith("vllm:") else ""
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{labels} {get()}"]
        for name, help_, hist in (
            ("vllm:time_to_first_token_seconds", "Arrival to first generated token.", self.ttft),
            ("vllm:request_time_per_output_token_seconds", "Mean time between tokens, per request.", self.tpot),
            ("vllm:e2e_request_latency_seconds", "Arrival to the last generated token.", self.e2e),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name, model)]
        name = "vllm:request_queue_time_seconds"
        lines += [f"# HELP {name} Arrival to first scheduled, by priority.", f"# TYPE {name} histogram"]
        for label, hist in sorted(self.queue_time.items()):
            lines += hist.lines(name, f'{model},priority="{_escape(label)}"')
        return "\n".join(lines) + "\n"


def _type(name: str) -> str:
    return f"# TYPE {name} counter"


def _escape(value: str) -> str:
    """A label value in the exposition format: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def resident_memory_bytes() -> float:
    """This process's RSS (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return 0.0
