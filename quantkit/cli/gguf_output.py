"""``quantkit quantize MODEL --format gguf:<MIX> -o model.gguf``: llama.cpp's own types, solved by GPTQ (or RTN),
written as one GGUF file; ``--format gguf:auto --target-bpw X`` chooses each tensor's type under a budget."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from quantkit.cli.app import out, write_json_option
from quantkit.data.calibration import CalibrationConfig
from quantkit.errors import QuantkitError

GGUF_PREFIX = "gguf:"
AUTO = "auto"
# job options a GGUF mix decides itself: the type of every tensor is the mix's
_SCHEME_OPTIONS = ("scheme", "bits", "group_size", "sym", "static_groups", "mse_clip")
# job options the GGUF output does not honour: refused rather than silently ignored
_UNSUPPORTED = {
    "--resume": lambda c: c.resume,
    "--ignore": lambda c: bool(c.ignore),
    "--kv-cache-scheme": lambda c: c.kv_cache_scheme is not None,
}


def gguf_mix_of(formats: list[str] | None) -> str | None:
    """The mix named by ``--format gguf:<MIX>`` (None: no such format); QuantkitError when it is combined."""
    typed = [f for f in formats or [] if f.lower().startswith(GGUF_PREFIX)]
    if not typed:
        return None
    if len(formats or []) > 1:
        raise QuantkitError(
            f"--format {typed[0]} writes the GGUF file as the checkpoint; give it alone "
            f"(got {', '.join(formats or [])})"
        )
    return typed[0][len(GGUF_PREFIX) :].upper()


def run_gguf_quantize(
    model: str,
    output: Path,
    mix: str,
    job_values: dict[str, Any],
    *,
    calibration: CalibrationConfig,
    calibration_file: Path | None,
    target_bpw: float | None,
    json_out: Path | None,
) -> None:
    from quantkit.export.gguf_typed import check_typed_model, write_typed_gguf
    from quantkit.memory import map_large_allocations
    from quantkit.model.resolve import resolve_model
    from quantkit.quantization.gguf.driver import GGUFOutputConfig, check_output, quantize_to_gguf
    from quantkit.quantization.gguf.mixes import mix_of
    from quantkit.quantization.gguf.solve import METHODS, SolveSettings
    from quantkit.quantization.methods.float_targets import FloatTargetsConfig
    from quantkit.quantization.methods.gptq import GPTQConfig
    from quantkit.quantization.methods.rotation import RotationConfig
    from quantkit.quantization.methods.rtn import RTNConfig
    from quantkit.quantization.options import config_from_options

    given = [o for o in _SCHEME_OPTIONS if job_values.get(o) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise QuantkitError(f"{flag} does not apply to --format gguf:{mix}: the mix decides every tensor's type")
    auto = mix == AUTO.upper()
    if auto and target_bpw is None:
        raise QuantkitError("--format gguf:auto needs --target-bpw (e.g. --target-bpw 4.8)")
    if target_bpw is not None and not auto:
        raise QuantkitError(f"--target-bpw chooses the types itself: use --format gguf:auto, not gguf:{mix}")
    if not auto:
        mix_of(mix)  # an unknown mix fails before any work
    else:
        from quantkit.mixed.gguf_budget import check_target

        check_target(float(target_bpw or 0))
    config = config_from_options(job_values, calibration=calibration, calibration_file=calibration_file)
    accepted = (GPTQConfig, RTNConfig, RotationConfig, FloatTargetsConfig)
    others = [type(c).__name__ for c in config.solvers if not isinstance(c, accepted)]
    rotation = next((c for c in config.solvers if isinstance(c, RotationConfig)), None)
    # --float-targets without GPTQ was refused by config_from_options, in the compressed-tensors path's words; with
    # gguf:auto the budget's ranking (round-to-nearest error under the float Hessians) does not depend on the
    # targets, so the planned types are solved on float targets like a named mix's
    float_targets = next((c for c in config.solvers if isinstance(c, FloatTargetsConfig)), None)
    if config.method not in METHODS or others:
        got = ", ".join(others) or config.method
        raise QuantkitError(f"--format gguf:{mix} solves with --method {' or '.join(METHODS)} alone; got {got}")
    if rotation is not None and auto:
        raise QuantkitError(
            "--rotate does not apply to --format gguf:auto: the budget is measured on the unrotated model with its "
            "head tied; name a mix (e.g. --format gguf:Q4_K_M)"
        )
    unsupported = [flag for flag, on in _UNSUPPORTED.items() if on(config)]
    if unsupported:
        raise QuantkitError(f"{unsupported[0]} does not apply to --format gguf:{mix} (not supported for GGUF output)")
    gptq = next((c for c in config.solvers if isinstance(c, GPTQConfig)), GPTQConfig())
    check_output(Path(output), config.force)
    source = resolve_model(model)
    import json

    check_typed_model(source, json.loads((source / "config.json").read_text()))
    settings = SolveSettings(method=config.method, act_order=bool(job_values.get("act_order")), gptq=gptq)
    job = GGUFOutputConfig(
        mix=mix if not auto else "Q4_K_M",
        solve=settings,
        calibration=calibration,
        calibration_file=calibration_file,
        batch_size=config.batch_size,
        force=config.force,
        device=config.device,
        show_progress=config.show_progress,
        rotation=rotation,
        float_targets=float_targets,
    )
    budget = None
    if auto:
        from quantkit.mixed.gguf_budget import plan_types

        budget = plan_types(model, job, target_bpw)
        job.types = budget.types
    map_large_allocations()
    result = quantize_to_gguf(model, job, Path(output), write_typed_gguf)
    out.print(_result_table(model, result))
    from quantkit.format.gguf_file import read_gguf_report, render_gguf_report

    report = read_gguf_report(result.output)
    out.print(render_gguf_report(report, list_tensors=False))
    fallbacks = [t for t in result.tensors if t.type != t.wanted]
    if fallbacks:
        out.print(_fallback_table(fallbacks))
    data = asdict(result) | {"output": str(result.output), "file": report.to_dict()}
    if budget is not None:
        data["budget"] = budget.to_dict()
    write_json_option(json_out, data)


def _result_table(model: str, result: Any) -> Table:
    folded = "" if result.rotation == "none" else f", {result.rotation} rotation folded in"
    folded += ", float targets" if result.float_targets else ""
    table = Table(title=f"Quantized {model} -> {result.output} (GGUF {result.mix}{folded})", title_justify="left")
    columns = ["method", "tensors", "fallbacks to RTN", "seconds", "peak RSS MB", "file MB"]
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(
        result.method,
        str(len(result.tensors)),
        str(sum(t.fell_back_to_rtn for t in result.tensors)),
        f"{result.seconds:.1f}",
        f"{result.peak_rss_mb:.0f}",
        f"{result.file_bytes / 1e6:.2f}",
    )
    return table


def _fallback_table(records: list[Any]) -> Table:
    """Tensors whose row length the mix's type does not divide get llama.cpp's fallback type: one row per
    (type, fallback, row length) with its tensors (each tensor's wanted and written type is in --json)."""
    groups: dict[tuple[str, str, int], list[str]] = {}
    for t in records:
        groups.setdefault((t.wanted, t.type, t.shape[-1]), []).append(t.name)
    table = Table(title="Row-length fallbacks (as llama.cpp's quantize makes them)", title_justify="left")
    for column in ("mix type", "written as", "in-features", "tensors", "which"):
        table.add_column(column, justify="left", overflow="fold")
    for (wanted, written, k), names in groups.items():
        kinds = sorted({name.split(".")[-2] if name.startswith("blk.") else name for name in names})
        table.add_row(wanted, written, str(k), str(len(names)), ", ".join(kinds))
    return table
