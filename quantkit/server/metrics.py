"""A few Prometheus metrics in the text exposition format (no client library needed)."""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {self.sum}", f"{name}_count {total}"]


@dataclass(slots=True)
class Metrics:
    """Updated on the event loop only; gauges are read from the engine's latest stats when scraped."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)  # (route, status code) -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(_TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(_TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(_E2E_BUCKETS))

    def count_request(self, route: str, code: int) -> None:
        self.requests[route, code] = self.requests.get((route, code), 0) + 1

    def observe_finished(
        self, prompt_tokens: int, completion_tokens: int, arrival: float, first: float | None, finish: float | None
    ) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        if first is not None:
            self.ttft.observe(first - arrival)
            if finish is not None and completion_tokens > 1:
                self.tpot.observe((finish - first) / (completion_tokens - 1))
        if finish is not None:
            self.e2e.observe(finish - arrival)

    def render(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> str:
        """``gauges``: name -> (help, getter)."""
        lines = ["# HELP quantkit_requests_total HTTP requests by route and status code.", _type("requests_total")]
        for (route, code), n in sorted(self.requests.items()):
            lines.append(f'quantkit_requests_total{{route="{route}",code="{code}"}} {n}')
        for name, help_, value in (
            ("prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("generation_tokens_total", "Generated tokens of finished requests.", self.generation_tokens),
        ):
            lines += [f"# HELP quantkit_{name} {help_}", _type(name), f"quantkit_{name} {value}"]
        for name, (help_, get) in gauges.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {get()}"]
        for name, help_, hist in (
            ("time_to_first_token_seconds", "Arrival to first generated token.", self.ttft),
            ("time_per_output_token_seconds", "Mean time between generated tokens, per request.", self.tpot),
            ("e2e_request_latency_seconds", "Arrival to the last generated token.", self.e2e),
        ):
            lines += [f"# HELP quantkit_{name} {help_}", f"# TYPE quantkit_{name} histogram"]
            lines += hist.lines(f"quantkit_{name}")
        return "\n".join(lines) + "\n"


def _type(name: str) -> str:
    return f"# TYPE quantkit_{name} counter"


def resident_memory_bytes() -> float:
    """This process's RSS (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return 0.0
