"""Serving from the command line: an OpenAI-compatible server, and a smoke test of one on loopback."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from rich.table import Table

from quantkit.cli.app import JsonOption, app, fail, out, write_json_option
from quantkit.cli.engine_options import engine_options, serve_options
from quantkit.memory import keep_freed_memory_for_reuse
from quantkit.runtime.config import EngineConfig
from quantkit.server.config import ServeConfig
from quantkit.server.smoke import SMOKE_MAX_TOKENS


@app.command()
@engine_options
@serve_options
def serve(
    model: Annotated[str, typer.Argument(help="Quantized checkpoint, HF model directory, hub id or alias.")],
    server: ServeConfig,
    engine: EngineConfig,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    from quantkit.server.runner import serve as run_server

    config = dataclasses.replace(server, engine=engine)
    keep_freed_memory_for_reuse()  # the decode loop reuses the same temporaries (quantkit/memory.py)
    run_server(model, config)


@app.command()
def smoke(
    checkpoint: Annotated[str, typer.Argument(help="Quantized checkpoint, HF model directory or alias.")],
    prompt: Annotated[list[str] | None, typer.Option(help="Prompt to send (repeatable; default: two).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Completion tokens per request.")] = SMOKE_MAX_TOKENS,
    json_out: JsonOption = None,
) -> None:
    """Start the server on loopback, check completion/chat/streaming answers against offline greedy output."""
    from quantkit.server.smoke import run_smoke

    keep_freed_memory_for_reuse()  # the serving engine's allocator policy (quantkit/memory.py)
    report = run_smoke(checkpoint, prompt or None, max_tokens)
    table = Table(title=f"Serving smoke test of {checkpoint}")
    for column in ("requests", "p50 latency s", "max latency s", "mean TTFT s", "tokens/s", "seconds"):
        table.add_column(column, justify="right")
    table.add_row(
        str(report.requests),
        f"{report.latency_p50_s:.3f}",
        f"{report.latency_max_s:.3f}",
        f"{report.ttft_mean_s:.3f}",
        f"{report.tokens_per_s:.1f}",
        f"{report.seconds:.1f}",
    )
    out.print(table)
    write_json_option(json_out, report.to_dict())
    if not report.ok:
        fail(report.failures, "smoke failed")
    out.print("[green]smoke test passed[/]")
