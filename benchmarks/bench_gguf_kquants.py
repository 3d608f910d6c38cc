"""llama.cpp's K-quant mixes: quantkit's GPTQ-solved files against llama.cpp's own, with and without an imatrix.

For each mix (Q4_K_M, Q5_K_M, Q3_K_M, Q6_K, Q2_K by default), three files of the same tensor types:

- ``llama-quantize`` of llama.cpp's float GGUF (convert_hf_to_gguf.py), without an importance matrix;
- the same with ``llama-imatrix``'s matrix over quantkit's shipped calibration text (128 chunks of 512, as
  quantkit's 128 calibration windows);
- ``quantkit quantize <model> --format gguf:<MIX> --method gptq`` (the codes chosen by GPTQ on the K-quant grid).

Every file is scored by ``llama-perplexity`` on quantkit's held-out text with ``--kl-divergence`` against the float
file's saved logits (perplexity ±, KL mean ±, KL p99, same top-1), and by ``quantkit eval FILE --compare
<llama.cpp imatrix file>`` for the paired perplexity difference with its confidence interval. ``llama-bench`` times
one pair (quantkit's and llama.cpp's Q4_K_M: same types, so the speed should match).

Steps reuse what an earlier run left under ``--work`` (delete a file to redo its step); llama.cpp is built as
``benchmarks.bench_gguf`` builds it.

    python -m benchmarks.bench_gguf_kquants --json bench_kquants.json --record gguf_kquants
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.bench_gguf import COMMANDS, SDIST, bits_per_weight, calibration_text, ensure_llama_cpp, run, timed

MIXES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K", "Q2_K")
TOOLS_EXTRA = "llama-bench"


@dataclass(slots=True)
class Scored:
    label: str
    mix: str
    maker: str  # "llama.cpp", "llama.cpp + imatrix" or "quantkit <method>"
    file: str
    bytes: int
    bpw: float
    perplexity: float
    perplexity_err: float
    kl_mean: float
    kl_mean_err: float
    kl_p99: float
    same_top: float  # percent
    same_top_err: float
    seconds_to_make: float | None


def _number(pattern: str, text: str, path: Path) -> tuple[float, ...]:
    found = re.search(pattern, text)
    if found is None:
        sys.exit(f"no match for {pattern!r} in the llama-perplexity output of {path}:\n{text[-2000:]}")
    return tuple(float(g) for g in found.groups())


def base_logits(tools: dict[str, Path], float_gguf: Path, text: Path, args: argparse.Namespace) -> Path:
    """The float file's logits over the evaluation text, saved once for every --kl-divergence run."""
    target = args.work / "float-logits.kld"
    cmd = [tools["llama-perplexity"], "-m", float_gguf, "-f", text, "-c", args.ctx, "-b", args.ctx]
    cmd += ["-t", args.threads, "--chunks", args.chunks, "--kl-divergence-base"]
    timed(lambda p: run([*cmd, p], args.work / "float-logits.log"), target)
    return target


def score(tools: dict[str, Path], path: Path, base: Path, text: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [tools["llama-perplexity"], "-m", path, "-f", text, "-c", args.ctx, "-b", args.ctx, "-t", args.threads]
    cmd += ["--chunks", args.chunks, "--kl-divergence-base", base, "--kl-divergence"]
    log = path.with_suffix(".kld.log")
    finished = log.exists() and "Same top p" in (output := log.read_text())  # a killed run's log is redone
    if not finished:
        output = run(cmd, log)
    ppl, ppl_err = _number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)", output, path)
    kl, kl_err = _number(r"Mean\s+KLD:\s*([\d.]+)\s*±\s*([\d.]+)", output, path)
    (p99,) = _number(r"99\.0%\s+KLD:\s*([\d.]+)", output, path)
    same, same_err = _number(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)", output, path)
    figures = {"perplexity": ppl, "perplexity_err": ppl_err, "kl_mean": kl, "kl_mean_err": kl_err, "kl_p99": p99}
    return figures | {"same_top": same, "same_top_err": same_err}


def llama_cpp_mix(tools: dict[str, Path], float_gguf: Path, mix: str, out: Path, imatrix: Path | None) -> None:
    cmd: list[str | Path] = [tools["llama-quantize"]]
    if imatrix is not None:
        cmd += ["--imatrix", imatrix]
    run([*cmd, float_gguf, out, mix], out.with_name(out.name.removeprefix("partial-")).with_suffix(".log"))


def quantkit_mix(model: str, mix: str, method: str, out: Path, windows: int | None) -> None:
    cmd = [sys.executable, "-m", "quantkit", "quantize", model, "--format", f"gguf:{mix}", "--method", method]
    if windows is not None:
        cmd += ["--num-samples", str(windows)]
    run([*cmd, "-o", out], out.with_name(out.name.removeprefix("partial-")).with_suffix(".log"))


def paired_json(path: Path, against: Path) -> Path:
    return path.with_suffix(f".vs-{against.stem}.json")


def paired(path: Path, against: Path, model: str) -> dict[str, object]:
    """``quantkit eval path --compare against``: the paired perplexity difference per window, with its verdict."""
    out = paired_json(path, against)
    if not out.exists():
        cmd = [sys.executable, "-m", "quantkit", "eval", path, "--compare", against, "--reference", model]
        run([*cmd, "--json", out], path.with_suffix(f".vs-{against.stem}.log"))
    return json.loads(out.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="float model (alias or HF directory)")
    parser.add_argument("--mixes", default=",".join(MIXES), help="llama.cpp mixes, comma-separated")
    parser.add_argument("--method", default="gptq", help="quantkit's method (rtn or gptq)")
    parser.add_argument("--num-windows", type=int, default=None, help="quantkit calibration windows (its default)")
    parser.add_argument("--work", type=Path, default=Path("/work/tmp/bench-gguf"), help="artifacts directory")
    parser.add_argument("--sdist", type=Path, default=SDIST, help="llama-cpp-python sdist with vendor/llama.cpp")
    parser.add_argument("--llama-src", type=Path, default=Path("/work/tmp/llama-src/llama.cpp"))
    parser.add_argument("--build-dir", type=Path, default=Path("/work/tmp/llama.cpp-build"))
    parser.add_argument("--ctx", type=int, default=512, help="context size of llama-perplexity and llama-imatrix")
    parser.add_argument("--chunks", type=int, default=64, help="llama-perplexity chunks")
    parser.add_argument("--imatrix-chunks", type=int, default=128, help="as quantkit's 128 calibration windows")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-paired", action="store_true", help="skip quantkit eval's paired comparisons")
    parser.add_argument("--no-speed", action="store_true", help="skip llama-bench")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and commands here")
    parser.add_argument("--record", default=None, help="record the table as benchmarks/results/<name>.json")
    parser.add_argument("--note", action="append", default=[], help="a reading of the figures for the record")
    return parser.parse_args(argv)


def float_and_imatrix(tools: dict[str, Path], model_dir: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """llama.cpp's float file and its importance matrix (the same names benchmarks.bench_gguf uses: shared)."""
    float_gguf, imatrix = args.work / "float-bf16.gguf", args.work / "imatrix.gguf"
    convert = [sys.executable, tools["convert"], model_dir, "--outtype", "bf16", "--outfile"]
    timed(lambda p: run([*convert, p]), float_gguf)
    cmd = [tools["llama-imatrix"], "-m", float_gguf, "-f", calibration_text(args.work), "-c", args.ctx]
    cmd += ["-b", args.ctx, "--chunks", args.imatrix_chunks, "-t", args.threads, "-o"]
    timed(lambda p: run([*cmd, p], args.work / "imatrix.log"), imatrix)
    return float_gguf, imatrix


def make_files(tools: dict[str, Path], float_gguf: Path, imatrix: Path, mix: str, args: argparse.Namespace) -> dict:
    """maker -> (file, seconds to make it or None when reused) for one mix."""
    work, low = args.work, mix.lower()
    plain, imat, ours = work / f"llamacpp-{low}.gguf", work / f"llamacpp-{low}-imat.gguf", work / f"quantkit-{low}.gguf"
    return {
        "llama.cpp": (plain, timed(lambda p: llama_cpp_mix(tools, float_gguf, mix, p, None), plain)),
        "llama.cpp + imatrix": (imat, timed(lambda p: llama_cpp_mix(tools, float_gguf, mix, p, imatrix), imat)),
        f"quantkit {args.method}": (
            ours,
            timed(lambda p: quantkit_mix(args.model, mix, args.method, p, args.num_windows), ours),
        ),
    }


def speed(tools: dict[str, Path], files: list[Path], args: argparse.Namespace) -> list[dict[str, object]]:
    """llama-bench's prompt and generation speed of each file (same types: the speeds should match)."""
    bench = args.build_dir / "bin" / TOOLS_EXTRA
    if not bench.is_file():
        return []
    cmd: list[str | Path] = [bench, "-p", "256", "-n", "64", "-t", args.threads, "-r", "3", "-o", "json"]
    for path in files:
        cmd += ["-m", path]
    output = run(cmd, args.work / "llama-bench.log")
    rows = json.loads(output[output.index("[") :])
    keep = ("model_filename", "n_prompt", "n_gen", "avg_ts", "stddev_ts")
    return [{k: r[k] for k in keep} for r in rows]


def table_rows(scored: list[Scored], verdicts: dict[str, dict[str, object]]) -> list[list[str]]:
    rows = []
    for s in scored:
        verdict = verdicts.get(s.label, {})
        paired_cell = str(verdict.get("text", "")) if verdict else ""
        rows.append(
            [
                s.mix,
                s.maker,
                f"{s.bytes:,}",
                f"{s.bpw:.3f}",
                f"{s.perplexity:.3f} ± {s.perplexity_err:.3f}",
                f"{s.kl_mean:.4f} ± {s.kl_mean_err:.4f}",
                f"{s.kl_p99:.3f}",
                f"{s.same_top:.2f} ± {s.same_top_err:.2f}",
                paired_cell,
            ]
        )
    return rows


COLUMNS = ["mix", "file", "bytes", "bits/w", "ppl", "KL mean", "KL p99", "same top-1 %", "paired vs imatrix"]


def print_table(rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="K-quant mixes in llama.cpp: llama-perplexity on held-out Persuasion, KL against the float")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("mix", "file", "paired vs imatrix") else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 180).print(table)


def _verdict_text(report: dict[str, object]) -> dict[str, object]:
    """One cell from ``quantkit eval --json``'s ``comparison``: the paired perplexity ratio (A over B, percent) with
    its 95% interval, and the verdict for A."""
    comparison = report.get("comparison")
    if not isinstance(comparison, dict):
        sys.exit(f"quantkit eval --compare wrote no comparison: {report}")
    low, high = comparison["perplexity_ratio_ci95_pct"]
    text = f"{comparison['perplexity_ratio_pct']:+.2f}% [{low:+.2f}, {high:+.2f}] {comparison['verdict']}"
    return {"text": text, "raw": comparison}


def record_notes(scored: list[Scored], verdicts: dict[str, dict[str, object]], speeds: list[dict]) -> list[str]:
    """The recorded table's notes, from the measurements themselves (a re-record keeps them)."""
    notes = []
    by_mix: dict[str, dict[str, Scored]] = {}
    for s in scored:
        by_mix.setdefault(s.mix, {})[s.maker] = s
    gaps = [
        abs(ours.bytes - theirs.bytes) / theirs.bytes
        for makers in by_mix.values()
        for maker, ours in makers.items()
        if maker.startswith("quantkit") and (theirs := makers.get("llama.cpp + imatrix")) is not None
    ]
    if gaps:
        notes.append(
            f"Same mix, same tensor types: every quantkit file is within {100 * max(gaps):.4f}% of llama.cpp's "
            "imatrix file's size (metadata only)."
        )
    notes.append(
        "llama-perplexity's ± is each file's own standard error over chunks, not a paired one; the paired column "
        "is quantkit eval's per-window comparison of quantkit's file with llama.cpp's imatrix file (40 windows of "
        "512 tokens, 95% interval)."
    )
    for label, verdict in verdicts.items():
        kl = verdict["raw"].get("kl_difference") if isinstance(verdict.get("raw"), dict) else None
        if isinstance(kl, dict):
            notes.append(
                f"{label}: paired KL difference {kl['mean']:+.4f} ± {kl['se']:.2g} ({kl['verdict']}) against "
                "llama.cpp's imatrix file."
            )
    times = [f"{s.label} {s.seconds_to_make:.0f} s" for s in scored if s.seconds_to_make is not None]
    if times:
        notes.append("Time to make (this run; the machine was shared, not a clean timing): " + ", ".join(times) + ".")
    notes += [
        f"llama-bench {Path(str(s['model_filename'])).name}: pp{s['n_prompt']}/tg{s['n_gen']} "
        f"{float(s['avg_ts']):.1f} ± {float(s['stddev_ts']):.1f} tokens/s"
        for s in speeds
    ]
    return notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from quantkit.data.sources import DEFAULT_EVALUATION
    from quantkit.model.resolve import resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    tools = ensure_llama_cpp(args.sdist, args.llama_src, args.build_dir, args.threads)
    float_gguf, imatrix = float_and_imatrix(tools, resolve_model(args.model), args)
    base = base_logits(tools, float_gguf, DEFAULT_EVALUATION, args)
    scored: list[Scored] = []
    verdicts: dict[str, dict[str, object]] = {}
    pair_for_speed: list[Path] = []
    for mix in [m.strip().upper() for m in args.mixes.split(",") if m.strip()]:
        files = make_files(tools, float_gguf, imatrix, mix, args)
        for maker, (path, seconds) in files.items():
            figures = score(tools, path, base, DEFAULT_EVALUATION, args)
            label = f"{mix} {maker}"
            scored.append(
                Scored(
                    label,
                    mix,
                    maker,
                    str(path),
                    path.stat().st_size,
                    bits_per_weight(path)[0],
                    **figures,
                    seconds_to_make=seconds,
                )
            )
        ours, theirs = files[f"quantkit {args.method}"][0], files["llama.cpp + imatrix"][0]
        if not args.no_paired or paired_json(ours, theirs).exists():  # --no-paired: only comparisons already made
            verdicts[f"{mix} quantkit {args.method}"] = _verdict_text(paired(ours, theirs, args.model))
        if mix == "Q4_K_M":
            pair_for_speed = [files["llama.cpp"][0], ours]
    speeds = speed(tools, pair_for_speed, args) if pair_for_speed and not args.no_speed else []
    rows = table_rows(scored, verdicts)
    print_table(rows)
    for s in speeds:
        print(
            f"llama-bench {Path(str(s['model_filename'])).name}: pp{s['n_prompt']} tg{s['n_gen']} "
            f"{float(s['avg_ts']):.1f} ± {float(s['stddev_ts']):.1f} t/s",
            flush=True,
        )
    if args.json is not None:
        report = {"model": args.model, "ctx": args.ctx, "chunks": args.chunks, "commands": COMMANDS}
        report |= {"rows": [asdict(s) for s in scored], "paired": verdicts, "speed": speeds}
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.record:
        from benchmarks.record import record_table

        notes = record_notes(scored, verdicts, speeds) + args.note
        record_table(
            args.record,
            title="llama.cpp K-quant mixes solved by GPTQ",
            order=61,
            protocol=(
                f"llama-quantize / llama-imatrix / llama-perplexity from the llama.cpp vendored in llama-cpp-python "
                f"0.3.36; `llama-perplexity -c {args.ctx} --chunks {args.chunks} --kl-divergence` on held-out "
                f"Persuasion against the float BF16 file's logits; imatrix over quantkit's calibration text "
                f"({args.imatrix_chunks} chunks of {args.ctx}); quantkit `--format gguf:<MIX> --method {args.method}` "
                f"with its default calibration; the paired column is `quantkit eval A --compare B` (A: quantkit's "
                f"file, B: llama.cpp's imatrix file of the same mix), per-window perplexity difference with its "
                f"95% interval."
            ),
            baseline="llama.cpp's own file of the same mix, with an importance matrix from the same text",
            columns=COLUMNS,
            rows=rows,
            notes=notes,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
