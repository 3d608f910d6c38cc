"""Mixed precision from the command line: measure sensitivity, then plan a scheme per unit under a budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantkit.cli.app import DeviceOption, app, err, out
from quantkit.data.calibration import CalibrationConfig
from quantkit.mixed.candidates import DEFAULT_CANDIDATES
from quantkit.mixed.measurement import MODE_HELP
from quantkit.mixed.outer_units import DEFAULT_OUTER
from quantkit.mixed.sensitivity import SensitivityConfig
from quantkit.quantization.methods.rotation import OFF as ROTATION_OFF
from quantkit.quantization.methods.rotation import RotationConfig


@app.command()
def sensitivity(
    model: Annotated[str, typer.Argument(help="Float model: local HF directory, hub id, or alias.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Measurement JSON to write.")],
    calib: Annotated[Path | None, typer.Option(help="Calibration file (default: shipped corpus).")] = None,
    candidates: Annotated[
        str, typer.Option(help="Comma list, e.g. int4-g128,int4-g64,int8,fp16; float ones: nvfp4,mxfp4,mxfp8,fp8.")
    ] = ",".join(DEFAULT_CANDIDATES),
    mode: Annotated[str, typer.Option(help=MODE_HELP)] = SensitivityConfig.mode,
    num_samples: Annotated[
        int, typer.Option(help="Without --calib: windows from the shipped corpus.")
    ] = CalibrationConfig.num_samples,
    seq_len: Annotated[int, typer.Option(help="Without --calib: tokens per window.")] = CalibrationConfig.seq_len,
    kl_windows: Annotated[
        int, typer.Option(help="kl/hybrid modes: calibration windows the KL is measured on.")
    ] = SensitivityConfig.kl_windows,
    act_order: Annotated[
        bool, typer.Option(help="Solve candidates with act-order (static groups).")
    ] = SensitivityConfig.act_order,
    mse_clip: Annotated[
        bool, typer.Option(help="Solve candidates with Hessian-weighted MSE clipping.")
    ] = SensitivityConfig.mse_clip,
    outer: Annotated[
        bool,
        typer.Option(
            "--outer/--no-outer",
            help="Also measure the head (GPTQ, as --quantize-head) and the embedding (RTN) as units, by final-logit "
            "KL, so that `plan --head auto --embedding auto` chooses them (hybrid and kl modes).",
        ),
    ] = False,
    outer_candidates: Annotated[
        str, typer.Option(help="With --outer: head/embedding schemes to measure beside float (int8, w<bits>g<group>).")
    ] = ",".join(DEFAULT_OUTER),
    rotate: Annotated[
        str,
        typer.Option(
            help="Measure on the model as `quantize --rotate hadamard` holds it (the same rotation folded in, the head "
            "untied), for a plan of a rotated run; none: the model as it is."
        ),
    ] = ROTATION_OFF,
    rotate_seed: Annotated[
        int, typer.Option(help="With --rotate: the rotation's seed (quantize's --rotate-seed).")
    ] = RotationConfig().seed,
    device: DeviceOption = SensitivityConfig.device,
) -> None:
    """Measure each layer's error under each candidate scheme (reusable for any budget).

    The default mode, hybrid, gives plans that beat uniform schemes; --mode proxy is the fast option.
    """
    from quantkit.mixed.sensitivity import measure_sensitivity
    from quantkit.mixed.summary import render_summary, summarize

    config = SensitivityConfig(
        candidates=[c.strip() for c in candidates.split(",") if c.strip()],
        mode=mode,
        kl_windows=kl_windows,
        act_order=act_order,
        mse_clip=mse_clip,
        calibration=CalibrationConfig(num_samples=num_samples, seq_len=seq_len),
        calibration_file=calib,
        device=device,
        outer=outer,
        outer_candidates=[c.strip() for c in outer_candidates.split(",") if c.strip()],
        rotation=RotationConfig(kind=rotate, seed=rotate_seed),
    )
    measurement = measure_sensitivity(model, config, output)
    title = f"Sensitivity ({mode}) of {model}: {len(measurement.units)} units -> {output}"
    out.print(render_summary(summarize(measurement), title))


@app.command()
def plan(
    measurement: Annotated[Path, typer.Argument(help="Measurement JSON from `quantkit sensitivity`.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan YAML to write.")],
    target_bits: Annotated[
        float | None, typer.Option(help="Average bits per weight over the measured linears.")
    ] = None,
    max_size_mb: Annotated[float | None, typer.Option(help="Size of the measured linears, in MB (10^6 bytes).")] = None,
    pin: Annotated[list[str] | None, typer.Option(help="REGEX=CANDIDATE forcing matching units (repeatable).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Draw predicted error against bits per weight to this PNG.")] = None,
    whole_model: Annotated[
        bool,
        typer.Option(
            "--whole-model/--linears-only",
            help="--max-size-mb counts the whole checkpoint (embedding, head, norms, biases, scales), not only the "
            "measured linears.",
        ),
    ] = False,
    head: Annotated[
        str,
        typer.Option(
            help="With --whole-model: the head scheme quantize --quantize-head will write (none: float), or auto: the "
            "planner chooses among those `sensitivity --outer` measured."
        ),
    ] = "none",
    untied_head: Annotated[
        bool,
        typer.Option(
            help="With --whole-model: the run unties a tied head (--rotate hadamard) and pays for it (implied by a "
            "measurement taken with --rotate)."
        ),
    ] = False,
    embedding: Annotated[
        str,
        typer.Option(
            help="With --whole-model: the embedding scheme quantize --quantize-embedding will write, or auto (as "
            "--head)."
        ),
    ] = "none",
) -> None:
    """Choose a scheme per unit minimising the predicted error under a bit budget (exact)."""
    from quantkit.errors import QuantkitError
    from quantkit.mixed.candidates import FP16
    from quantkit.mixed.measurement import load_measurement
    from quantkit.mixed.plan_file import render_plan, render_uniform_comparison, save_plan
    from quantkit.mixed.planner import parse_pin, uniform_points
    from quantkit.mixed.planner import plan as make_plan

    if (target_bits is None) == (max_size_mb is None):
        raise QuantkitError("give exactly one budget: --target-bits (e.g. 4.5) or --max-size-mb")
    loaded = load_measurement(measurement)
    pins = [parse_pin(p) for p in pin or []]
    whole = whole_model or head != "none" or untied_head or embedding != "none"
    if whole:
        if max_size_mb is None or not whole_model:
            raise QuantkitError(
                "--head, --embedding and --untied-head size a whole-model budget: give --whole-model --max-size-mb"
            )
        from quantkit.mixed.whole_plan import whole_model_plan
        from quantkit.model.resolve import resolve_model

        source = resolve_model(loaded.model)
        chosen = whole_model_plan(
            loaded, source, max_size_mb, head=head, embedding=embedding, untied_head=untied_head, pins=pins
        )
    else:
        chosen = make_plan(loaded, target_bits=target_bits, max_size_mb=max_size_mb, pins=pins)
    save_plan(chosen, output)
    out.print(render_plan(chosen))
    if whole:
        from quantkit.mixed.plan_outer import quantize_hint

        outside = chosen.whole_model_mb - chosen.size_mb
        schemes = ", ".join(
            f"{o.name}: {o.scheme}" + ("" if o.error is None else f" (predicted error {o.error:.4g})")
            for o in chosen.outer
        )
        tied = "" if chosen.outer_scheme("head") is not None else "head: tied, "
        out.print(
            f"whole model: {chosen.whole_model_mb:.3f} MB of files at most (budget {max_size_mb} MB): the plan's "
            f"linears {chosen.size_mb:.3f} MB + {outside:.3f} MB outside them and the headers ({tied}{schemes}); "
            f"predicted error {chosen.whole_error:.4g} in all",
            soft_wrap=True,
        )
        out.print(quantize_hint(chosen, str(output)), soft_wrap=True)
    uniform = [p for p in uniform_points(loaded) if p.candidate != FP16]
    if uniform:
        out.print(render_uniform_comparison(chosen, uniform))
    if loaded.mode == "proxy":
        err.print(
            "note: this measurement is proxy mode (the fast option): proxy errors rank a layer's own candidates but "
            "are not comparable across layers; below ~5 bits per weight a plan from the default "
            "`quantkit sensitivity` (--mode hybrid) beats uniform schemes where proxy plans lost"
        )
    if plot is not None:
        from quantkit.mixed.plot import plot_frontier

        plot_frontier(loaded, chosen, plot)
        out.print(f"plot: {plot}")
