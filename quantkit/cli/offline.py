"""The offline commands: calibrate, quantize, eval, inspect. Each builds one config and calls one function."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from quantkit.cli.app import DeviceOption, JsonOption, ModelOption, app, err, out, write_json_option
from quantkit.data.calibration import FORCE_SMALL_FLAG, MIN_TEXT_COVERAGE, CalibrationConfig
from quantkit.eval.evaluate import EvalConfig
from quantkit.export.run import COMPRESSED_TENSORS
from quantkit.format.engines import LAYOUT_POLICY_HELP
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.config import DEFAULT_METHOD, QuantizeConfig
from quantkit.quantization.methods import METHODS
from quantkit.quantization.solvers.gptq import GPTQConfig
from quantkit.quantization.solvers.tune import TuneConfig
from quantkit.rotation.config import ROTATION_KINDS, RotationConfig

NumSamples = Annotated[int, typer.Option(help="Number of windows.")]
SeqLen = Annotated[int, typer.Option(help="Tokens per window.")]
TextColumn = Annotated[str, typer.Option(help="Text field of jsonl/json/parquet/HF records.")]
AllowSmallCalibration = Annotated[
    bool,
    typer.Option(
        FORCE_SMALL_FLAG,
        help=f"Use a text that covers under {MIN_TEXT_COVERAGE:.0%} of the requested tokens (windows overlap).",
    ),
]


@app.command()
def calibrate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Safetensors file to write.")],
    model: ModelOption = "smollm2-135m",
    dataset: Annotated[
        str | None,
        typer.Option(help="File (.txt/.jsonl/.json/.parquet), directory, or HF dataset name[:config][:split]."),
    ] = CalibrationConfig.dataset,
    num_samples: NumSamples = CalibrationConfig.num_samples,
    seq_len: SeqLen = CalibrationConfig.seq_len,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same windows).")] = CalibrationConfig.seed,
    strategy: Annotated[
        str, typer.Option(help="random (windows over the joined text) or document.")
    ] = CalibrationConfig.strategy,
    min_length: Annotated[
        int | None, typer.Option(help="document strategy: minimum document tokens.")
    ] = CalibrationConfig.min_length,
    select: Annotated[
        str, typer.Option(help="random, or diverse (TF-IDF + k-means coverage).")
    ] = CalibrationConfig.select,
    text_column: TextColumn = CalibrationConfig.text_column,
    allow_small_calibration: AllowSmallCalibration = CalibrationConfig.allow_small,
) -> None:
    """Collect calibration token windows (default text: the shipped Jane Austen corpus)."""
    from quantkit.data.calibration import build_calibration

    config = CalibrationConfig(
        dataset=dataset,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        strategy=strategy,
        min_length=min_length,
        select=select,
        text_column=text_column,
        allow_small=allow_small_calibration,
    )
    result = build_calibration(model, config, output=output)
    table = Table(title="Calibration", title_justify="left")
    table.add_column("field", overflow="fold")
    table.add_column("value", overflow="fold")
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
    ] = EvalConfig.dataset,
    seq_len: SeqLen = EvalConfig.seq_len,
    max_windows: Annotated[
        int | None, typer.Option(help="Evaluate at most this many windows.")
    ] = EvalConfig.max_windows,
    all_windows: Annotated[
        bool, typer.Option(help="Evaluate every window of the text (instead of --max-windows).")
    ] = False,
    stride: Annotated[int | None, typer.Option(help="Window stride (default: non-overlapping).")] = EvalConfig.stride,
    reference: Annotated[
        str | None,
        typer.Option(help="Reference model: its perplexity, the change in percent, KL divergence, top-1 agreement."),
    ] = EvalConfig.reference,
    batch_size: Annotated[
        int, typer.Option(help="Windows per forward pass (each holds its logits while scored).")
    ] = EvalConfig.batch_size,
    text_column: TextColumn = EvalConfig.text_column,
    device: DeviceOption = EvalConfig.device,
    json_out: JsonOption = None,
) -> None:
    """Perplexity, and with --reference: the reference's perplexity and the change in percent, KL divergence
    (mean, p99) and top-1 agreement."""
    from quantkit.eval.evaluate import evaluate
    from quantkit.eval.report import eval_table

    config = EvalConfig(
        dataset=dataset,
        seq_len=seq_len,
        max_windows=None if all_windows else max_windows,
        stride=stride,
        reference=reference,
        batch_size=batch_size,
        text_column=text_column,
        device=device,
    )
    result = evaluate(model, config)
    write_json_option(json_out, result.to_dict())
    out.print(eval_table(result))


@app.command()
def quantize(
    model: Annotated[str, typer.Argument(help="Float model: local HF directory, hub id, or alias (smollm2-135m).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Checkpoint directory to write.")],
    method: Annotated[str, typer.Option(help=f"{', '.join(METHODS)}.")] = DEFAULT_METHOD,
    bits: Annotated[int, typer.Option(help="Weight bits: 2, 3, 4 or 8.")] = QuantScheme.bits,
    group_size: Annotated[
        int, typer.Option(help="Columns per scale group; -1 for per-channel.")
    ] = QuantScheme.group_size,
    sym: Annotated[
        bool | None,
        typer.Option("--sym/--asym", help="Symmetric or asymmetric (default: sym; asym for AWQ, as in AutoAWQ)."),
    ] = None,
    act_order: Annotated[
        bool | None,
        typer.Option(help="GPTQ: columns by descending Hessian diagonal (default: on for gptq and awq+gptq)."),
    ] = None,
    static_groups: Annotated[
        bool | None, typer.Option(help="With --act-order: groups fixed in column order (no g_idx; default on).")
    ] = None,
    mse_clip: Annotated[
        bool | None,
        typer.Option(help="Search a shrunken range per group, weighted by the Hessian (default: on for gptq)."),
    ] = None,
    damp: Annotated[float, typer.Option(help="GPTQ damping, as a fraction of the mean Hessian diagonal.")] = (
        GPTQConfig.damp
    ),
    block_size: Annotated[int, typer.Option(help="GPTQ lazy-update block size.")] = GPTQConfig.block_size,
    float_targets: Annotated[
        bool,
        typer.Option(
            help="GPTQ: fit each linear to the float model's outputs (and the residual stream's error), not to its "
            "own outputs on the quantized inputs (GPTAQ); a regression on the calibration tokens: use 256 windows, "
            "and --rotate hadamard (unrotated outlier channels make it worse than plain GPTQ)."
        ),
    ] = GPTQConfig.float_targets,
    calib: Annotated[
        Path | None,
        typer.Option(help="Calibration file from `quantkit calibrate` (default: shipped corpus; rtn uses none)."),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            help="Without --calib: text to draw windows from (file, directory or HF dataset; default: shipped corpus)."
        ),
    ] = CalibrationConfig.dataset,
    num_samples: Annotated[
        int, typer.Option(help="Without --calib: windows drawn from the text.")
    ] = CalibrationConfig.num_samples,
    seq_len: Annotated[int, typer.Option(help="Without --calib: tokens per window.")] = CalibrationConfig.seq_len,
    allow_small_calibration: AllowSmallCalibration = CalibrationConfig.allow_small,
    ignore: Annotated[
        list[str] | None, typer.Option(help="Regex of linears to keep in float (repeatable); lm_head always is.")
    ] = None,
    plan: Annotated[Path | None, typer.Option(help="Mixed-precision plan YAML from `quantkit plan`.")] = None,
    rotate: Annotated[
        str, typer.Option(help=f"Rotation folded into the weights before solving: {', '.join(ROTATION_KINDS)}.")
    ] = RotationConfig().kind,
    rotate_seed: Annotated[int, typer.Option(help="Seed of the rotation's random signs.")] = RotationConfig().seed,
    tune_steps: Annotated[
        int, typer.Option(help="Block-output tuning of rounding and scales after the solver: steps per block (0: off).")
    ] = 0,
    tune_lr: Annotated[
        float, typer.Option(help="Tuning: Adam learning rate of the rounding offsets (decays linearly to 0).")
    ] = TuneConfig.lr,
    tune_scale_lr: Annotated[
        float, typer.Option(help="Tuning: Adam learning rate of the group-scale multipliers.")
    ] = TuneConfig.scale_lr,
    tune_batch_windows: Annotated[
        int, typer.Option(help="Tuning: calibration windows per step.")
    ] = TuneConfig.batch_windows,
    refit_head: Annotated[
        bool,
        typer.Option(help="Refit the float head to the quantized body (needs an untied head, or --rotate)."),
    ] = QuantizeConfig.refit_head,
    layout_policy: Annotated[str, typer.Option(help=LAYOUT_POLICY_HELP)] = QuantizeConfig.layout_policy,
    formats: Annotated[
        list[str] | None,
        typer.Option("--format", help="Also export: gptq (<out>-gptq/) or gguf (<out>.gguf); repeatable."),
    ] = None,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run after its last finished block.")] = False,
    force: Annotated[
        bool, typer.Option(help="Replace an existing output directory (once the new one is done).")
    ] = False,
    batch_size: Annotated[int, typer.Option(help="Calibration windows per forward pass.")] = QuantizeConfig.batch_size,
    max_shard_size: Annotated[
        int, typer.Option(help="Largest checkpoint shard, in MB (held in memory).")
    ] = QuantizeConfig.max_shard_bytes // 1_000_000,
    device: DeviceOption = QuantizeConfig.device,
    json_out: JsonOption = None,
) -> None:
    """Quantize a model layer by layer into a packed compressed-tensors checkpoint."""
    from quantkit.quantization.methods import check_float_targets, expand_method, resolve_scheme
    from quantkit.quantization.pipeline import quantize_model

    check_float_targets(method, float_targets)
    gptq = GPTQConfig(damp=damp, block_size=block_size, float_targets=float_targets)  # checked for every method
    options = {"symmetric": sym, "act_order": act_order, "static_groups": static_groups, "mse_clip": mse_clip}
    config = QuantizeConfig(
        solvers=[gptq if isinstance(s, GPTQConfig) else s for s in expand_method(method)],
        scheme=resolve_scheme(method, bits=bits, group_size=group_size, **options),
        calibration=CalibrationConfig(
            dataset=dataset, num_samples=num_samples, seq_len=seq_len, allow_small=allow_small_calibration
        ),
        calibration_file=calib,
        ignore=list(ignore or []),
        rotation=RotationConfig(kind=rotate, seed=rotate_seed),  # type: ignore[arg-type]
        tune=TuneConfig(steps=tune_steps, lr=tune_lr, scale_lr=tune_scale_lr, batch_windows=tune_batch_windows),
        refit_head=refit_head,
        layout_policy=layout_policy,
        resume=resume,
        force=force,
        batch_size=batch_size,
        max_shard_bytes=max_shard_size * 1_000_000,
        device=device,
    )
    if plan is not None:
        from quantkit.mixed.plan_apply import planned_schemes

        config.planned = planned_schemes(plan, model)
    exports = [f for f in dict.fromkeys(formats or []) if f != COMPRESSED_TENSORS]
    config.export_formats = exports
    if exports:
        from quantkit.export.run import check_exports_of_model
        from quantkit.model.resolve import resolve_model

        check_exports_of_model(resolve_model(model), exports)
    if not config.needs_calibration and calib is not None:
        err.print(f"note: rtn is data-free; the calibration file '{calib}' is not used")
    if calib is not None and dataset is not None:
        err.print(f"note: --calib '{calib}' holds the windows; --dataset is not used")
    result = quantize_model(model, config, output)
    if result.already_complete:
        out.print(f"{output} is already complete (same model, data and options); nothing was redone", soft_wrap=True)
    table = Table(title=f"Quantized {model} -> {output} (on {result.device})", title_justify="left")
    columns = ["method", "scheme", "layers", "fallbacks", "seconds", "peak RSS MB", "size MB"]
    if result.peak_device_mb is not None:
        columns.insert(6, "peak GPU MB")
    for column in columns:
        table.add_column(column, justify="right", overflow="fold")
    schemes = sorted({r.scheme for r in result.records})
    row = [
        result.method,
        ", ".join(schemes),
        str(len(result.records)),
        str(sum(r.fell_back_to_rtn for r in result.records)),
        f"{result.seconds:.1f}",
        f"{result.peak_rss_mb:.0f}",
        f"{result.checkpoint_bytes / 1e6:.1f}",
    ]
    if result.peak_device_mb is not None:
        row.insert(6, f"{result.peak_device_mb:.0f}")
    table.add_row(*row)
    out.print(table)
    summaries = _export_all(output, exports)
    exported = {"exports": [asdict(s) for s in summaries]} if summaries else {}
    write_json_option(json_out, asdict(result) | {"output": str(result.output)} | exported)


def _export_all(checkpoint: Path, formats: list[str]) -> list:
    from quantkit.cli.export import print_export
    from quantkit.export.run import default_export_path, export_checkpoint

    summaries = []
    for fmt in formats:
        summaries.append(export_checkpoint(checkpoint, fmt, default_export_path(checkpoint, fmt), force=True))
        print_export(summaries[-1])
    return summaries


@app.command()
def inspect(
    checkpoint: Annotated[Path, typer.Argument(help="A quantized checkpoint directory.")],
    reference: Annotated[Path | None, typer.Option(help="The original model directory, for the size ratio.")] = None,
    json_out: JsonOption = None,
) -> None:
    """Layers in natural order grouped by scheme, with per-scheme sums: bits per weight (scales and zeros
    counted) and sizes in MB (10^6 bytes) against the original."""
    from quantkit.format.inspect import inspect_checkpoint, render_report
    from quantkit.model.resolve import resolve_model

    report = inspect_checkpoint(checkpoint, resolve_model(str(reference)) if reference else None)
    out.print(render_report(report))
    write_json_option(json_out, report.to_dict())
