"""The offline commands: calibrate, quantize, eval, inspect. Each builds one config and calls one function."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from quantkit.cli.app import DeviceOption, JsonOption, ModelOption, app, err, out, write_json_option
from quantkit.cli.job_options import with_job_options
from quantkit.data.calibration import FORCE_SMALL_FLAG, MIN_TEXT_COVERAGE, CalibrationConfig
from quantkit.eval.behaviour import BehaviourConfig
from quantkit.eval.evaluate import EvalConfig
from quantkit.export.run import COMPRESSED_TENSORS

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
        typer.Option(
            help="File (.txt/.jsonl/.json/.parquet), directory, HF dataset name[:config][:split], or self (text the "
            "model generates: data-free)."
        ),
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
    compare: Annotated[
        str | None,
        typer.Option(
            help="A second model scored on the same windows: the paired difference (95% interval) and whether "
            "MODEL is better, worse or indistinguishable."
        ),
    ] = EvalConfig.compare,
    batch_size: Annotated[
        int, typer.Option(help="Windows per forward pass (each holds its logits while scored).")
    ] = EvalConfig.batch_size,
    text_column: TextColumn = EvalConfig.text_column,
    device: DeviceOption = EvalConfig.device,
    behaviour: Annotated[
        bool,
        typer.Option(
            "--behaviour",
            help="Also generate greedy replies to the shipped chat prompts with MODEL and the reference: end rate, "
            "repetition, first-32-token agreement, reasoning tags closed (needs a chat template).",
        ),
    ] = False,
    behaviour_prompts: Annotated[
        int | None,
        typer.Option(help=f"With --behaviour: the first N shipped prompts (default {BehaviourConfig.prompts})."),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help=f"With --behaviour: tokens a reply may take before it counts as not ended "
            f"(default {BehaviourConfig.max_new_tokens})."
        ),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Perplexity, and with --reference: the reference's perplexity and the change in percent, KL divergence
    (mean, p99) and top-1 agreement; with --behaviour, how the replies of MODEL and the reference compare."""
    from quantkit.errors import QuantkitError
    from quantkit.eval.evaluate import evaluate
    from quantkit.eval.report import behaviour_table, eval_table

    if not behaviour and (behaviour_prompts is not None or max_new_tokens is not None):
        raise QuantkitError("--behaviour-prompts and --max-new-tokens apply to --behaviour; add --behaviour")
    replies = BehaviourConfig(
        prompts=BehaviourConfig.prompts if behaviour_prompts is None else behaviour_prompts,
        max_new_tokens=BehaviourConfig.max_new_tokens if max_new_tokens is None else max_new_tokens,
    )

    config = EvalConfig(
        dataset=dataset,
        seq_len=seq_len,
        max_windows=None if all_windows else max_windows,
        stride=stride,
        reference=reference,
        compare=compare,
        batch_size=batch_size,
        text_column=text_column,
        device=device,
        behaviour=replies if behaviour else None,
    )
    result = evaluate(model, config)
    write_json_option(json_out, result.to_dict())
    out.print(eval_table(result))
    if result.behaviour is not None:
        out.print(behaviour_table(result.behaviour))


@app.command()
@with_job_options
def quantize(
    model: Annotated[str, typer.Argument(help="Float model: local HF directory, hub id, or alias (smollm2-135m).")],
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="Checkpoint directory to write (with --format gguf:<MIX>: the .gguf file)."
        ),
    ],
    calib: Annotated[
        Path | None,
        typer.Option(help="Calibration file from `quantkit calibrate` (default: shipped corpus; rtn uses none)."),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            help="Without --calib: text to draw windows from (file, directory, HF dataset, or self: text the model "
            "generates, data-free; default: shipped corpus)."
        ),
    ] = CalibrationConfig.dataset,
    num_samples: Annotated[
        int, typer.Option(help="Without --calib: windows drawn from the text.")
    ] = CalibrationConfig.num_samples,
    seq_len: Annotated[int, typer.Option(help="Without --calib: tokens per window.")] = CalibrationConfig.seq_len,
    allow_small_calibration: AllowSmallCalibration = CalibrationConfig.allow_small,
    plan: Annotated[Path | None, typer.Option(help="Mixed-precision plan YAML from `quantkit plan`.")] = None,
    formats: Annotated[
        list[str] | None,
        typer.Option(
            "--format",
            help="Also export: gptq (<out>-gptq/) or gguf (<out>.gguf); repeatable. Or gguf:<MIX> alone (Q4_K_M, "
            "Q5_K_M, Q6_K, Q3_K_M, Q2_K, ...: llama.cpp's mixes, solved on their own grids): -o names the .gguf "
            "file, which is the checkpoint; gguf:auto with --target-bpw chooses each tensor's type. With --rotate "
            "hadamard the rotation folds into the file, whose head is then untied (output.weight): SmolLM2-135M's "
            "Q4_K_M tensors grow from 103.7 to 123.1 MB (+19.5 MB, +19%). With --float-targets (GPTQ) each linear "
            "is solved on its GGML grid toward the float model's outputs.",
        ),
    ] = None,
    target_bpw: Annotated[
        float | None,
        typer.Option(
            help="With --format gguf:auto: bits per weight of the GGUF tensors (llama.cpp's BPW), from 2.6 to 8.5; "
            "each tensor's K-quant type is chosen by the exact planner to least Hessian-weighted error."
        ),
    ] = None,
    json_out: JsonOption = None,
    job_values: dict | None = None,
) -> None:
    """Quantize a model layer by layer into a packed compressed-tensors checkpoint; ends with the coverage audit
    (every weight's kind, asked and written scheme, bytes, summed per kind)."""
    from quantkit.distributed.context import is_main_process, refuse_under_torchrun
    from quantkit.errors import QuantkitError
    from quantkit.format.coverage import audit_checkpoint
    from quantkit.format.coverage_table import coverage_tables
    from quantkit.memory import map_large_allocations
    from quantkit.quantization.options import config_from_options
    from quantkit.quantization.pipeline import quantize_model

    calibration = CalibrationConfig(
        dataset=dataset, num_samples=num_samples, seq_len=seq_len, allow_small=allow_small_calibration
    )
    from quantkit.cli.gguf_output import gguf_mix_of, run_gguf_quantize

    mix = gguf_mix_of(formats)
    if mix is not None:
        refuse_under_torchrun(f"--format gguf:{mix}")
        if plan is not None:
            raise QuantkitError("--plan holds compressed-tensors schemes; with --format gguf:auto use --target-bpw")
        run_gguf_quantize(
            model,
            output,
            mix,
            job_values or {},
            calibration=calibration,
            calibration_file=calib,
            target_bpw=target_bpw,
            json_out=json_out,
        )
        return
    if target_bpw is not None:
        raise QuantkitError("--target-bpw applies to --format gguf:auto")
    if plan is not None:  # a whole-model plan sets --quantize-head / --quantize-embedding as it sized them
        from quantkit.mixed.plan_apply import with_planned_outer

        job_values = with_planned_outer(plan, job_values or {})
    config = config_from_options(job_values or {}, calibration=calibration, calibration_file=calib)
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
        err.print(f"note: {config.method} is data-free; the calibration file '{calib}' is not used")
    if calib is not None and dataset is not None:
        err.print(f"note: --calib '{calib}' holds the windows; --dataset is not used")
    map_large_allocations()  # the offline policy for this process: see quantkit/memory.py
    result = quantize_model(model, config, output)
    if not is_main_process():  # under torchrun: rank 0 reports, audits and exports
        return
    if result.already_complete:
        out.print(f"{output} is already complete (same model, data and options); nothing was redone", soft_wrap=True)
    out.print(_result_table(model, output, result))
    audit = audit_checkpoint(output)
    out.print(coverage_tables(audit, list_exceptions=False))
    summaries = _export_all(output, exports)
    exported = {"exports": [asdict(s) for s in summaries]} if summaries else {}
    fields = {"output": str(result.output), "coverage": audit.to_dict()}
    write_json_option(json_out, asdict(result) | fields | exported)


def _result_table(model: str, output: Path, result: Any) -> Table:
    table = Table(title=f"Quantized {model} -> {output} (on {result.device})", title_justify="left")
    columns = ["method", "scheme", "layers", "fallbacks", "seconds", "peak RSS MB", "size MB"]
    if result.processes > 1:
        columns.append("processes")
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
    if result.processes > 1:
        row.append(str(result.processes))
    table.add_row(*row)
    return table


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
    checkpoint: Annotated[Path, typer.Argument(help="A quantized checkpoint directory, or a .gguf file.")],
    reference: Annotated[Path | None, typer.Option(help="The original model directory, for the size ratio.")] = None,
    json_out: JsonOption = None,
) -> None:
    """Layers in natural order grouped by scheme, with per-scheme sums: bits per weight (scales and zeros
    counted) and sizes in MB (10^6 bytes) against the original; then the coverage audit (every weight per kind,
    asked and written scheme, fallbacks)."""
    from quantkit.format.coverage import audit_checkpoint
    from quantkit.format.coverage_table import coverage_tables
    from quantkit.format.gguf_file import is_gguf_file, read_gguf_report, render_gguf_report
    from quantkit.format.inspect import inspect_checkpoint, render_report
    from quantkit.model.resolve import resolve_model

    if is_gguf_file(checkpoint):  # per-tensor types and bytes, sums per type, whole-file bits per weight
        gguf_report = read_gguf_report(checkpoint)
        out.print(render_gguf_report(gguf_report))
        write_json_option(json_out, gguf_report.to_dict())
        return
    report = inspect_checkpoint(checkpoint, resolve_model(str(reference)) if reference else None)
    audit = audit_checkpoint(checkpoint)
    out.print(render_report(report))
    out.print(coverage_tables(audit))
    write_json_option(json_out, report.to_dict() | {"coverage": audit.to_dict()})
