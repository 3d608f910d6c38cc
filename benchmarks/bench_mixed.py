"""Mixed precision under a budget vs the best uniform scheme that fits the same budget (SmolLM2).

One sensitivity measurement, then for each budget: the planned checkpoint's perplexity and KL against the
original, next to the best uniform scheme whose size fits that budget (lowest KL among those measured).
Also reports the Spearman rank correlation between the plans' predicted error and their real KL.

    python -m benchmarks.bench_mixed --budgets 3.5,4.25,4.5,5,6,8 --samples 128 --eval-windows 40 --mode hybrid

Uniform schemes, plans and the sensitivity measurement are all solved with the method's default solver options
(for gptq: act-order with static groups and Hessian-weighted MSE clipping), as `quantkit quantize` does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quantkit.data.calibration import CalibrationConfig
from quantkit.eval.evaluate import EvalConfig, evaluate
from quantkit.mixed.candidates import parse_candidate
from quantkit.mixed.measurement import MODES, load_measurement
from quantkit.mixed.plan_apply import planned_schemes
from quantkit.mixed.plan_file import save_plan
from quantkit.mixed.planner import plan
from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import with_solver_options
from quantkit.quantization.pipeline import quantize_model

CANDIDATES = ["int3-g64", "int4-g128", "int4-g64", "int4-g32", "int8", "fp16"]


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _params_by_candidate(chosen) -> dict[str, float]:
    """Share of the planned weights each candidate got."""
    share: dict[str, float] = {}
    for unit in chosen.units:
        share[unit.candidate] = share.get(unit.candidate, 0.0) + unit.params / chosen.total_params
    return {k: round(v, 4) for k, v in sorted(share.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", default="3.5,4.25,4.5,5,6,8")
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--mode", choices=MODES, default="hybrid", help="sensitivity mode")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--uniform", default=None, help="uniform schemes to compare (default: every candidate)")
    parser.add_argument("--measurement", type=Path, default=None, help="reuse a saved measurement JSON")
    parser.add_argument("--save-measurement", type=Path, default=None, help="write the new measurement here")
    parser.add_argument("--json", type=Path, default=None, help="results, rewritten after every run")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 140))  # wide tables stay readable in logs
    budgets = [float(b) for b in args.budgets.split(",")]
    candidates = args.candidates.split(",")
    options = QuantizeConfig.of(args.method).resolved_scheme()  # the method's solver options for every run
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        calibration = CalibrationConfig(num_samples=args.samples, seq_len=args.seq_len)
        start = time.perf_counter()
        if args.measurement is not None:
            measurement = load_measurement(args.measurement)
            candidates = measurement.candidates
        else:
            config = SensitivityConfig(
                candidates=candidates,
                mode=args.mode,
                act_order=options.act_order,
                mse_clip=options.mse_clip,
                calibration=calibration,
            )
            measurement = measure_sensitivity(args.model, config, args.save_measurement)
        sensitivity_s = measurement.metadata.get("seconds", time.perf_counter() - start)
        uniform_names = args.uniform.split(",") if args.uniform else [c for c in candidates if c != "fp16"]
        params = measurement.total_params

        def run(name: str, **quant_kw) -> dict:
            out = root / name
            quant_kw.setdefault("scheme", options)  # a plan's schemes take the run's solver options
            t0 = time.perf_counter()
            config = QuantizeConfig.for_method(args.method, calibration=calibration, **quant_kw)
            quantize_model(args.model, config, out)
            quantize_s = round(time.perf_counter() - t0, 1)
            e = evaluate(out, EvalConfig(max_windows=args.eval_windows, reference=args.model, show_progress=False))
            return {"perplexity": e.perplexity, "kl": e.kl_mean, "top1": e.top1_agreement, "quantize_s": quantize_s}

        uniform: dict[str, dict] = {}
        rows: list[dict] = []

        def dump() -> None:  # partial results survive an interrupted sweep
            if args.json:
                payload = {"mode": measurement.mode, "rows": rows, "uniform": uniform}
                args.json.write_text(json.dumps({**payload, "sensitivity_seconds": sensitivity_s}, indent=2))

        for name in uniform_names:
            bpw = sum(u.options[name].bits for u in measurement.units) / params
            scheme = with_solver_options(parse_candidate(name), options)
            uniform[name] = {"bpw": bpw, **run(f"uniform-{name}", scheme=scheme)}
            dump()
        for budget in budgets:
            chosen = plan(measurement, target_bits=budget)
            plan_file = save_plan(chosen, root / f"plan-{budget}.yaml")
            result = run(f"plan-{budget}", planned=planned_schemes(plan_file, args.model))
            fits = {k: v for k, v in uniform.items() if v["bpw"] <= budget}
            best = min(fits.items(), key=lambda kv: kv[1]["kl"]) if fits else None
            rows.append(
                {
                    "budget": budget,
                    "plan_bpw": chosen.bits_per_weight,
                    "predicted": chosen.predicted_error,
                    "params_by_candidate": _params_by_candidate(chosen),
                    **result,
                    "uniform": best[0] if best else None,
                    "uniform_result": best[1] if best else None,
                }
            )
            dump()
    table = Table(
        title=f"Mixed precision vs uniform on {args.model} ({args.method}, {args.samples}x{args.seq_len} "
        f"calibration, {args.eval_windows} eval windows)"
    )
    for col in (
        "budget",
        "plan bits/w",
        "plan ppl",
        "plan KL",
        "best uniform",
        "uniform bits/w",
        "uniform ppl",
        "uniform KL",
        "KL ratio",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        u = r["uniform_result"]
        table.add_row(
            f"{r['budget']:.2f}",
            f"{r['plan_bpw']:.3f}",
            f"{r['perplexity']:.3f}",
            f"{r['kl']:.4f}",
            r["uniform"] or "none fits",
            f"{u['bpw']:.3f}" if u else "-",
            f"{u['perplexity']:.3f}" if u else "-",
            f"{u['kl']:.4f}" if u else "-",
            f"{r['kl'] / u['kl']:.2f}" if u else "-",
        )
    console.print(table)
    rho = spearman([r["predicted"] for r in rows], [r["kl"] for r in rows])
    console.print(f"Spearman(predicted error, real KL) over {len(rows)} plans: {rho:.3f}")
    console.print(f"Sensitivity measurement ({measurement.mode}, {len(candidates)} candidates): {sensitivity_s:.0f} s")
    if args.json:
        payload = {
            "mode": measurement.mode,
            "rows": rows,
            "uniform": uniform,
            "spearman": rho,
            "sensitivity_seconds": sensitivity_s,
        }
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
