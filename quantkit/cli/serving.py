"""Serving from the command line: an OpenAI-compatible server, and a smoke test of one on loopback."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from quantkit.cli.app import JsonOption, app, fail, out, write_json_option
from quantkit.cli.engine_options import engine_options
from quantkit.memory import keep_freed_memory_for_reuse
from quantkit.runtime.config import EngineConfig
from quantkit.server.config import ServeConfig
from quantkit.server.smoke import SMOKE_MAX_TOKENS


@app.command()
@engine_options
def serve(
    model: Annotated[str, typer.Argument(help="Quantized checkpoint, HF model directory, hub id or alias.")],
    engine: EngineConfig,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = ServeConfig.host,
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = ServeConfig.port,
    api_key: Annotated[
        str | None, typer.Option(envvar="QUANTKIT_API_KEY", help="Require this bearer token (not on /health).")
    ] = ServeConfig.api_key,
    max_queue: Annotated[
        int, typer.Option(help="Requests waiting beyond the running batch; more get 429.")
    ] = ServeConfig.max_queue,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            help="Model name clients send and see in /v1/models and responses (default: the alias, the model "
            "directory's name or the hub id; never a local path)."
        ),
    ] = ServeConfig.served_model_name,
    drain_timeout: Annotated[
        float, typer.Option(help="Seconds running requests get after SIGTERM.")
    ] = ServeConfig.drain_timeout,
    max_body_bytes: Annotated[
        int, typer.Option(help="Largest request body in bytes; a bigger one gets 413.")
    ] = ServeConfig.max_body_bytes,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds a client has to send its whole request body; a slower one gets 408.")
    ] = ServeConfig.body_timeout,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = ServeConfig.log_level,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    from quantkit.server.runner import serve as run_server

    config = ServeConfig(
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        max_queue=max_queue,
        drain_timeout=drain_timeout,
        max_body_bytes=max_body_bytes,
        body_timeout=body_timeout,
        log_level=log_level,
        engine=engine,
    )
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
