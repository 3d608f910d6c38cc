"""The `quantkit` command line: each command builds a config dataclass and calls one library function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from quantkit import __version__
from quantkit.data.calibration_config import CalibrationConfig
from quantkit.errors import QuantkitError
from quantkit.eval.eval_config import EvalConfig

app = typer.Typer(
    name="quantkit",
    help="Quantize Hugging Face causal LMs (RTN, GPTQ, AWQ, mixed precision), evaluate and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(emoji=False)
err = Console(stderr=True, emoji=False, highlight=False)
EXIT_INPUT_ERROR = 2


def _version(value: bool) -> None:
    if value:
        out.print(f"quantkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """quantkit: offline quantization and model compression for causal LMs."""


ModelArg = Annotated[str, typer.Option("--model", "-m", help="Local HF directory, hub id, or alias (smollm2-135m).")]


@app.command()
def calibrate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Safetensors file to write.")],
    model: ModelArg = "smollm2-135m",
    dataset: Annotated[
        str | None,
        typer.Option(help="File (.txt/.jsonl/.json/.parquet), directory, or HF dataset name[:config][:split]."),
    ] = None,
    num_samples: Annotated[int, typer.Option(help="Number of windows.")] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 512,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same windows).")] = 0,
    strategy: Annotated[str, typer.Option(help="random (windows over the joined text) or document.")] = "random",
    min_length: Annotated[int | None, typer.Option(help="document strategy: minimum document tokens.")] = None,
    select: Annotated[str, typer.Option(help="random, or diverse (TF-IDF + k-means coverage).")] = "random",
    text_column: Annotated[str, typer.Option(help="Text field of jsonl/json/parquet/HF records.")] = "text",
) -> None:
    """Collect calibration token windows (default text: the shipped Jane Austen corpus)."""
    from quantkit.data.calibration import build_calibration

    config = CalibrationConfig(
        model=model,
        dataset=dataset,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        strategy=strategy,
        min_length=min_length,
        select=select,
        text_column=text_column,
        output=output,
    )
    result = build_calibration(config)
    table = Table(title="Calibration")
    table.add_column("field")
    table.add_column("value")
    meta = result.calibration.metadata
    for key, value in (
        ("output", str(output)),
        ("windows", f"{result.calibration.num_samples} x {result.calibration.seq_len}"),
        ("source", meta["source"]),
        ("documents", str(result.documents)),
        ("source tokens", f"{result.source_tokens:,}"),
        ("source sha256", meta["source_hash"][:16]),
        ("seconds", f"{result.seconds:.1f}"),
    ):
        table.add_row(key, value)
    out.print(table)


@app.command("eval")
def eval_(
    model: Annotated[str, typer.Argument(help="Model or quantized checkpoint: directory, hub id, or alias.")],
    dataset: Annotated[
        str | None, typer.Option(help="Evaluation text (file, directory or HF dataset); default: held-out Persuasion.")
    ] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 512,
    max_windows: Annotated[int | None, typer.Option(help="Evaluate at most this many windows.")] = None,
    stride: Annotated[int | None, typer.Option(help="Window stride (default: non-overlapping).")] = None,
    reference: Annotated[
        str | None, typer.Option(help="Reference model for KL divergence and top-1 agreement.")
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass.")] = 4,
    text_column: Annotated[str, typer.Option(help="Text field of jsonl/json/parquet/HF records.")] = "text",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as one JSON object.")] = None,
) -> None:
    """Perplexity, and with --reference: KL divergence (mean, p99) and top-1 agreement."""
    from quantkit.eval.evaluate import evaluate

    config = EvalConfig(
        model=model,
        dataset=dataset,
        seq_len=seq_len,
        max_windows=max_windows,
        stride=stride,
        reference=reference,
        batch_size=batch_size,
        text_column=text_column,
        json_path=json_out,
    )
    result = evaluate(config)
    table = Table(title=f"Evaluation of {model}")
    for column in ("perplexity", "tokens", "windows", "seq len", "KL mean", "KL p99", "top-1 agree", "seconds"):
        table.add_column(column, justify="right")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    table.add_row(
        f"{result.perplexity:.3f}",
        f"{result.tokens:,}",
        str(result.windows),
        str(result.seq_len),
        fmt(result.kl_mean, ".5f"),
        fmt(result.kl_p99, ".4f"),
        fmt(result.top1_agreement, ".4f"),
        f"{result.seconds:.1f}",
    )
    out.print(table)


@app.command()
def quantize(
    model: Annotated[str, typer.Argument(help="Float model: local HF directory, hub id, or alias (smollm2-135m).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Checkpoint directory to write.")],
    method: Annotated[str, typer.Option(help="rtn, gptq, awq or awq+gptq.")] = "gptq",
    bits: Annotated[int, typer.Option(help="Weight bits: 2, 3, 4 or 8.")] = 4,
    group_size: Annotated[int, typer.Option(help="Columns per scale group; -1 for per-channel.")] = 128,
    sym: Annotated[
        bool | None,
        typer.Option("--sym/--asym", help="Symmetric or asymmetric (default: sym; asym for AWQ, as in AutoAWQ)."),
    ] = None,
    act_order: Annotated[
        bool | None,
        typer.Option(help="GPTQ: columns by descending Hessian diagonal (default: on for gptq and awq+gptq)."),
    ] = None,
    static_groups: Annotated[
        bool, typer.Option(help="With --act-order: groups fixed in column order (no g_idx; default on).")
    ] = True,
    mse_clip: Annotated[
        bool | None,
        typer.Option(help="Search a shrunken range per group, weighted by the Hessian (default: on for gptq)."),
    ] = None,
    damp: Annotated[float, typer.Option(help="GPTQ damping, as a fraction of the mean Hessian diagonal.")] = 0.01,
    block_size: Annotated[int, typer.Option(help="GPTQ lazy-update block size.")] = 128,
    calib: Annotated[
        Path | None,
        typer.Option(help="Calibration file from `quantkit calibrate` (default: shipped corpus; rtn uses none)."),
    ] = None,
    num_samples: Annotated[int, typer.Option(help="Without --calib: windows drawn from the shipped corpus.")] = 128,
    seq_len: Annotated[int, typer.Option(help="Without --calib: tokens per window.")] = 512,
    ignore: Annotated[
        list[str] | None, typer.Option(help="Regex of linears to keep in float (repeatable); lm_head always is.")
    ] = None,
    plan: Annotated[Path | None, typer.Option(help="Mixed-precision plan YAML from `quantkit plan`.")] = None,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run after its last finished block.")] = False,
    force: Annotated[
        bool, typer.Option(help="Replace an existing output directory (once the new one is done).")
    ] = False,
    batch_size: Annotated[int, typer.Option(help="Calibration windows per forward pass.")] = 4,
    max_shard_size: Annotated[int, typer.Option(help="Largest checkpoint shard, in MB (held in memory).")] = 1024,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write a JSON summary.")] = None,
) -> None:
    """Quantize a model layer by layer into a packed compressed-tensors checkpoint."""
    from dataclasses import asdict

    from quantkit.atomic import write_json
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.config import QuantizeConfig
    from quantkit.quantize.methods import default_solver_options
    from quantkit.quantize.pipeline import quantize_model

    if sym is None:
        sym = not method.startswith("awq")  # AWQ defaults to asymmetric, as in AutoAWQ
    defaults = default_solver_options(method)
    act_order = defaults["act_order"] if act_order is None else act_order
    mse_clip = defaults["mse_clip"] if mse_clip is None else mse_clip
    scheme = QuantScheme(
        bits=bits,
        group_size=group_size,
        symmetric=sym,
        act_order=act_order,
        static_groups=static_groups,
        mse_clip=mse_clip,
    )
    config = QuantizeConfig(
        model=model,
        output=output,
        method=method,
        scheme=scheme,
        damp=damp,
        block_size=block_size,
        calib=calib,
        num_samples=num_samples,
        seq_len=seq_len,
        ignore=list(ignore or []),
        plan=plan,
        resume=resume,
        force=force,
        batch_size=batch_size,
        max_shard_bytes=max_shard_size * 1_000_000,
    )
    if method == "rtn" and calib is not None:
        err.print(f"note: rtn is data-free; the calibration file '{calib}' is not used")
    result = quantize_model(config)
    table = Table(title=f"Quantized {model} -> {output}")
    for column in ("method", "scheme", "layers", "fallbacks", "seconds", "peak RSS MB", "size MB"):
        table.add_column(column, justify="right")
    schemes = sorted({r.scheme for r in result.records})
    table.add_row(
        result.method,
        ", ".join(schemes),
        str(len(result.records)),
        str(sum(r.fell_back_to_rtn for r in result.records)),
        f"{result.seconds:.1f}",
        f"{result.peak_rss_mb:.0f}",
        f"{result.checkpoint_bytes / 1e6:.1f}",
    )
    out.print(table)
    if json_out is not None:
        data = asdict(result)
        data["output"] = str(result.output)
        write_json(json_out, data)


@app.command()
def sensitivity(
    model: Annotated[str, typer.Argument(help="Float model: local HF directory, hub id, or alias.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Measurement JSON to write.")],
    calib: Annotated[Path | None, typer.Option(help="Calibration file (default: shipped corpus).")] = None,
    candidates: Annotated[
        str, typer.Option(help="Comma list of candidates, e.g. int4-g128,int4-g64,int4-g32,int8,fp16.")
    ] = "int4-g128,int4-g64,int4-g32,int8,fp16",
    mode: Annotated[
        str,
        typer.Option(help="proxy (Hessian-weighted error), kl (final-logit KL, slow) or hybrid (proxy scaled to KL)."),
    ] = "proxy",
    num_samples: Annotated[int, typer.Option(help="Without --calib: windows from the shipped corpus.")] = 128,
    seq_len: Annotated[int, typer.Option(help="Without --calib: tokens per window.")] = 512,
    kl_windows: Annotated[int, typer.Option(help="kl/hybrid modes: calibration windows the KL is measured on.")] = 2,
    act_order: Annotated[bool, typer.Option(help="Solve candidates with act-order (static groups).")] = True,
    mse_clip: Annotated[bool, typer.Option(help="Solve candidates with Hessian-weighted MSE clipping.")] = True,
) -> None:
    """Measure each layer's error under each candidate scheme (reusable for any budget)."""
    from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity

    config = SensitivityConfig(
        model=model,
        output=output,
        calib=calib,
        candidates=[c.strip() for c in candidates.split(",") if c.strip()],
        mode=mode,
        num_samples=num_samples,
        seq_len=seq_len,
        kl_windows=kl_windows,
        act_order=act_order,
        mse_clip=mse_clip,
    )
    measurement = measure_sensitivity(config)
    table = Table(title=f"Sensitivity ({mode}) of {model}: {len(measurement.units)} units -> {output}")
    table.add_column("candidate")
    table.add_column("bits/weight", justify="right")
    table.add_column("total error", justify="right")
    table.add_column("worst unit", justify="left")
    params = measurement.total_params
    for name in measurement.candidates:
        costs = [(u.options[name], u.name) for u in measurement.units]
        worst = max(costs, key=lambda c: c[0].error)
        table.add_row(
            name, f"{sum(c.bits for c, _ in costs) / params:.3f}", f"{sum(c.error for c, _ in costs):.4g}", worst[1]
        )
    out.print(table)


@app.command()
def plan(
    measurement: Annotated[Path, typer.Argument(help="Measurement JSON from `quantkit sensitivity`.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan YAML to write.")],
    target_bits: Annotated[
        float | None, typer.Option(help="Average bits per weight over the measured linears.")
    ] = None,
    max_size_mb: Annotated[float | None, typer.Option(help="Size of the measured linears, in MB (1e6 bytes).")] = None,
    pin: Annotated[list[str] | None, typer.Option(help="REGEX=CANDIDATE forcing matching units (repeatable).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Draw predicted error against bits per weight to this PNG.")] = None,
) -> None:
    """Choose a scheme per unit minimising the predicted error under a bit budget (exact)."""
    from quantkit.errors import QuantkitError
    from quantkit.mixed.measurement import load_measurement
    from quantkit.mixed.plan_file import render_plan, save_plan
    from quantkit.mixed.planner import parse_pin
    from quantkit.mixed.planner import plan as make_plan

    if (target_bits is None) == (max_size_mb is None):
        raise QuantkitError("give exactly one budget: --target-bits (e.g. 4.5) or --max-size-mb")
    loaded = load_measurement(measurement)
    chosen = make_plan(loaded, target_bits=target_bits, max_size_mb=max_size_mb, pins=[parse_pin(p) for p in pin or []])
    save_plan(chosen, output)
    out.print(render_plan(chosen))
    if loaded.mode == "proxy":
        err.print(
            "note: proxy errors rank a layer's own candidates but are not comparable across layers; below ~5 bits "
            "per weight a plan from `quantkit sensitivity --mode hybrid` beats uniform schemes where proxy plans lost"
        )
    if plot is not None:
        from quantkit.mixed.plot import plot_frontier

        plot_frontier(loaded, chosen, plot)
        out.print(f"plot: {plot}")


@app.command()
def inspect(
    checkpoint: Annotated[Path, typer.Argument(help="A quantized checkpoint directory.")],
    reference: Annotated[Path | None, typer.Option(help="The original model directory, for the size ratio.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
) -> None:
    """Scheme per layer, bits per weight (scales and zeros counted), size against the original."""
    from quantkit.atomic import write_json
    from quantkit.format.inspect import inspect_checkpoint, render_report
    from quantkit.model.resolve import resolve_model

    report = inspect_checkpoint(checkpoint, resolve_model(str(reference)) if reference else None)
    out.print(render_report(report))
    if json_out is not None:
        write_json(json_out, report.to_dict())


@app.command("run")
def run_(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (see `quantkit recipe new`).")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a key, e.g. --set quantization.scheme.bits=8.")
    ] = None,
    report: Annotated[Path | None, typer.Option(help="Report directory (default: <output>/report).")] = None,
) -> None:
    """Run a recipe: calibrate, quantize, evaluate, check the gates; exit 1 when a gate fails."""
    from quantkit.recipes.run import render_tables, run_recipe
    from quantkit.recipes.schema import load_recipe

    loaded = load_recipe(recipe, list(set_ or []))
    result = run_recipe(loaded, recipe_path=recipe, report_dir=report, console=out)
    for table in render_tables(result):
        out.print(table)
    out.print(f"report: {result.report_dir}")
    if not result.passed:
        for line in result.failures():
            err.print(f"[bold red]gate failed:[/] {escape(line)}", soft_wrap=True)
        raise typer.Exit(1)
    out.print("[green]all gates passed[/]")


recipe_app = typer.Typer(help="Validate or create recipe files.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("validate")
def recipe_validate(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML to check.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a key, as for `quantkit run`.")] = None,
) -> None:
    """Check a recipe against the schema (keys, types, values, regexes, ${ENV}); print the resolved recipe."""
    from quantkit.recipes.schema import dump_recipe, load_recipe

    loaded = load_recipe(recipe, list(set_ or []))
    out.print(escape(dump_recipe(loaded)), end="")
    out.print(f"[green]{escape(str(recipe))} is valid[/]")


@recipe_app.command("new")
def recipe_new(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="File to write (default: print).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented starting recipe (W4 GPTQ on smollm2-135m) that validates."""
    from quantkit.recipes.starter import write_starter

    text = write_starter(output, force=force)
    if output is None:
        print(text, end="")
    else:
        out.print(f"wrote {output}; run it with `quantkit run {output}`")


@app.command()
def serve(
    model: Annotated[str, typer.Argument(help="Quantized checkpoint, HF model directory, hub id or alias.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8000,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences in the running batch at most.")] = 32,
    max_model_len: Annotated[int | None, typer.Option(help="Prompt + completion tokens at most.")] = None,
    kv_cache_blocks: Annotated[int | None, typer.Option(help="KV-cache blocks (default: sized from memory).")] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="QUANTKIT_API_KEY", help="Require this bearer token (not on /health).")
    ] = None,
    max_queue: Annotated[int, typer.Option(help="Requests waiting beyond the running batch; more get 429.")] = 256,
    served_model_name: Annotated[str | None, typer.Option(help="Model name clients send (default: MODEL).")] = None,
    drain_timeout: Annotated[float, typer.Option(help="Seconds running requests get after SIGTERM.")] = 30.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    from quantkit.server.config import ServeConfig
    from quantkit.server.runner import serve as run_server

    config = ServeConfig(
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        max_queue=max_queue,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        kv_cache_blocks=kv_cache_blocks,
        drain_timeout=drain_timeout,
        log_level=log_level,
    )
    run_server(model, config)


@app.command()
def smoke(
    checkpoint: Annotated[str, typer.Argument(help="Quantized checkpoint, HF model directory or alias.")],
    prompt: Annotated[list[str] | None, typer.Option(help="Prompt to send (repeatable; default: two).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Completion tokens per request.")] = 16,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
) -> None:
    """Start the server on loopback, check completion/chat/streaming answers against offline greedy output."""
    import json

    from quantkit.server.smoke import run_smoke

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
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if not report.ok:
        for line in report.failures:
            err.print(f"[bold red]smoke failed:[/] {escape(line)}", soft_wrap=True)
        raise typer.Exit(1)
    out.print("[green]smoke test passed[/]")


def main() -> None:
    """Console entry point: user errors become one red line and exit code 2, never a traceback."""
    try:
        app()
    except QuantkitError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(EXIT_INPUT_ERROR)
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
