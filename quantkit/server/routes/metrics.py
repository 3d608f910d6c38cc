"""``GET /metrics``: the Prometheus text of :class:`~quantkit.server.metrics.Metrics` plus the catalogue of series
read from the engine's latest stats when scraped (vLLM's names where the meaning is vLLM's, see
:mod:`quantkit.server.metrics`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from quantkit.server.metrics import Sampled, resident_memory_bytes
from quantkit.server.state import ServerState

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    text = state.metrics.render(state.model_name, sampled_series(state))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def sampled_series(state: ServerState) -> Sampled:
    """name -> (type, help, getter) of every series read at scrape time."""
    stats, engine = state.engine.stats, state.engine
    return {
        "vllm:num_requests_running": ("gauge", "Sequences in the running batch.", lambda: stats.running),
        "vllm:num_requests_waiting": ("gauge", "Sequences waiting for admission.", lambda: stats.waiting),
        "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage; 1 means 100 percent.", lambda: stats.kv_usage),
        "vllm:num_preemptions_total": (
            "counter", "Sequences preempted (sent back to waiting, recomputed later).", lambda: stats.preemptions
        ),
        "quantkit_num_requests_in_flight": (
            "gauge", "HTTP requests being served.", lambda: state.engine.num_in_flight
        ),
        "quantkit_kv_cache_free_blocks": ("gauge", "Free KV blocks.", lambda: stats.free_blocks),
        "quantkit_spec_decode_acceptance_rate": (
            "gauge", "Draft tokens accepted / drafted (speculative decoding).", lambda: stats.spec_acceptance
        ),
        "quantkit_spec_decode_tokens_per_step": (
            "gauge", "Tokens per target pass of a sequence with drafts.", lambda: stats.spec_tokens_per_step
        ),
        "quantkit_engine_healthy": (
            "gauge", "1 while the engine thread runs and its recent steps did not all fail (as /health).",
            lambda: float(engine.health() is None),
        ),
        "quantkit_engine_failed_steps_total": (
            "counter", "Engine steps in which every request failed, or that raised.", lambda: stats.failed_steps
        ),
        "process_resident_memory_bytes": ("gauge", "Resident memory of the server process.", resident_memory_bytes),
    }  # fmt: skip
