"""quantkit against llm-compressor (vllm-project/llm-compressor) on the same model, data, scheme and evaluation.

llm-compressor pins torch/transformers/compressed-tensors versions that conflict with quantkit's, so it runs in
its own virtual environment (``--llmc-python``), through benchmarks/llmc_worker.py. Setting that environment up:

    python3 -m venv /work/tmp/llmc-venv
    /work/tmp/llmc-venv/bin/pip install torch==2.13.0     # first: the CPU build, not pip's CUDA default
    /work/tmp/llmc-venv/bin/pip install llmcompressor==0.14.0.1

Then (QUANTKIT_CACHE / HF_HUB_OFFLINE as needed to find the converted model offline):

    python -m benchmarks.bench_llmcompressor --llmc-python /work/tmp/llmc-venv/bin/python --llmc-no-pin-memory \
        --json bench_llmc.json
    python -m benchmarks.bench_llmcompressor --llmc-python ... --num-samples 4 --seq-len 64 --eval-windows 2  # smoke

Steps:

1. ``quantkit calibrate`` draws the calibration windows once (default 128 x 512 from the shipped Austen corpus,
   seed 0) into one safetensors file (``--calib`` reuses an existing file instead).
2. For each method (gptq: W4 g64 symmetric; awq: W4 g64 asymmetric), each library quantizes the float model in a
   subprocess, whose wall clock and peak RSS (``os.wait4``'s ``ru_maxrss`` of that child) are measured here the
   same way for both:
   - quantkit: ``quantkit quantize MODEL --method M --bits 4 --group-size 64 --calib FILE`` with its defaults
     (gptq: act-order with static groups, Hessian-weighted MSE clipping, damp 0.01, block 128; awq: AWQ scales and
     clipping, then round-to-nearest, asymmetric);
   - llm-compressor: ``oneshot`` with ``GPTQModifier`` (config_groups W4 int symmetric group 64, targets Linear,
     ignore lm_head; its defaults otherwise: actorder static, dampening_frac 0.01, block_size 128, min-max
     observer) or ``AWQModifier()`` + ``QuantizationModifier`` (same scheme, asymmetric; duo_scaling, n_grid 20;
     no clipping search), saved with ``save_pretrained(save_compressed=True)``. The model is loaded with
     ``dtype="auto"`` (bf16, as stored, so scales and unquantized tensors are bf16 like quantkit's) unless
     ``--llmc-dtype`` says otherwise. What each modifier actually used is in the JSON (``llmc_info``).
     On a CPU-only machine llm-compressor's AWQ (0.13.0, 0.14.x) fails as released ("RuntimeError: Cannot access
     accelerator device when none is available.", from pinning its cached activations); ``--llmc-no-pin-memory``
     turns that pinning into a no-op (no numerical effect; see benchmarks/llmc_worker.py), and the row is marked.
3. Every checkpoint is evaluated by the same code, in a subprocess:
   ``quantkit eval CKPT --reference MODEL --max-windows N --json`` (held-out Persuasion, 512-token windows):
   perplexity, its change against the float model on the same tokens, KL divergence and top-1 agreement.
   quantkit's loader reads both libraries' ``pack-quantized`` compressed-tensors checkpoints; as a cross-check its
   logits on one calibration window are compared with transformers' own compressed-tensors decompression of the
   same checkpoint (``loader_check``, column "loader max|dlogit|"; skip with ``--no-loader-check``).
4. A table, a second one with what each checkpoint's quantization_config records (and each library's own timing:
   quantkit's run, llm-compressor's ``oneshot`` call), and ``--json OUT`` with every row, the commands run,
   versions, llm-compressor's modifier settings as used and each checkpoint's quantization_config.

"Same data" means: both libraries see the identical token ids, the windows of one ``quantkit calibrate`` file
(with the BOS prefix quantkit adds where the tokenizer has one; SmolLM2's has none). llm-compressor gets them as a
pre-tokenized ``datasets.Dataset`` (``input_ids`` plus an all-ones ``attention_mask``), which it uses as given: no
re-tokenization, chat template, concatenation or padding; ``num_calibration_samples`` = the number of windows and
``max_seq_length`` = their length, so nothing is dropped or truncated (a recording collator in the worker checks
that exactly these windows were fed: ``same_windows_fed``). Only the order could differ (llm-compressor's
length-aware sampler argsorts equal lengths; ``same_order`` says), which changes no statistic but float rounding.
The evaluation text is held out from both. What is not the same, by each library's defaults: quantkit computes its
decoder blocks in float32 during calibration (hidden states kept in bf16 between blocks), llm-compressor in the
loaded dtype (bf16 with ``--llmc-dtype auto``); both accumulate GPTQ Hessians in float32.

Timings are for the whole subprocess (interpreter start, imports, model load, calibration, save) on the same
machine and thread count; on a busy machine compare them only within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

WORKER = Path(__file__).resolve().with_name("llmc_worker.py")
LIBRARIES = ("quantkit", "llmcompressor")
METHODS = {"gptq": "W4 g64 sym", "awq": "W4 g64 asym"}  # what each method is compared at
COMMANDS: list[str] = []


@dataclass
class Run:
    """One subprocess: its command, exit status, wall clock and peak RSS."""

    command: list[str]
    returncode: int
    seconds: float
    peak_rss_mb: float
    log: str


@dataclass
class Row:
    library: str
    method: str
    scheme: str
    checkpoint: str
    seconds: float | None = None
    peak_rss_mb: float | None = None
    safetensors_mb: float | None = None
    perplexity: float | None = None
    perplexity_change_pct: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None
    error: str | None = None
    quantization_config: dict | None = None
    inner_seconds: dict | float | None = None  # what the library itself reports (quantkit: its run; llmc: phases)
    eval: dict | None = None
    extra: dict = field(default_factory=dict)


def run(cmd: list[str | Path], log: Path, env: dict[str, str] | None = None) -> Run:
    """Run ``cmd`` with stdout+stderr into ``log``; wall clock and the child's own peak RSS (``os.wait4``)."""
    text = [str(c) for c in cmd]
    COMMANDS.append(shlex.join(text))
    print(f"$ {shlex.join(text)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(text, stdout=sink, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Run(text, proc.returncode, seconds, usage.ru_maxrss / 1024, str(log))  # ru_maxrss: KiB on Linux


def tail(path: str | Path, lines: int = 25) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def quantkit_cmd(*args: str | Path) -> list[str | Path]:
    return [sys.executable, "-m", "quantkit", *args]


def safetensors_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def read_quant_config(path: Path) -> dict | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("quantization_config")


def weight_args(quant_config: dict | None) -> dict:
    """The first config group's weight arguments (both libraries write one group here)."""
    groups = (quant_config or {}).get("config_groups") or {}
    for group in groups.values():
        return group.get("weights") or {}
    return {}


def quantize_quantkit(method: str, model: str, calib: Path, out: Path, bits: int, group: int) -> tuple[Run, dict]:
    summary = out.with_name(out.name + ".quantize.json")
    cmd = quantkit_cmd("quantize", model, "-o", out, "--force", "--json", summary)
    cmd += ["--method", method, "--bits", str(bits), "--group-size", str(group), "--calib", calib]
    result = run(cmd, out.with_name(out.name + ".log"))
    return result, json.loads(summary.read_text()) if result.returncode == 0 and summary.is_file() else {}


def quantize_llmc(
    method: str,
    llmc_python: Path,
    model_dir: Path,
    calib: Path,
    out: Path,
    bits: int,
    group: int,
    dtype: str,
    no_pin_memory: bool,
) -> tuple[Run, dict]:
    info = out.with_name(out.name + ".info.json")
    cmd: list[str | Path] = [llmc_python, WORKER, "--model", model_dir, "--calib", calib, "--method", method]
    cmd += ["--bits", str(bits), "--group-size", str(group), "--dtype", dtype, "--output", out, "--info", info]
    if no_pin_memory:
        cmd.append("--no-pin-memory")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = run(cmd, out.with_name(out.name + ".log"), env=env)
    return result, json.loads(info.read_text()) if result.returncode == 0 and info.is_file() else {}


def evaluate_checkpoint(ckpt: Path, model: str, windows: int) -> tuple[Run, dict]:
    out = ckpt.with_name(ckpt.name + ".eval.json")
    cmd = quantkit_cmd("eval", ckpt, "--reference", model, "--max-windows", str(windows), "--json", out)
    result = run(cmd, ckpt.with_name(ckpt.name + ".eval.log"))
    return result, json.loads(out.read_text()) if result.returncode == 0 and out.is_file() else {}


def loader_check(ckpt: Path, input_ids) -> dict:
    """Logits of quantkit's loader (what ``quantkit eval`` scores) against transformers' own compressed-tensors
    decompression of the same checkpoint, on one calibration window: a difference would mean the evaluation
    reads one library's format differently from the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from quantkit.model.resolve import load_model

    hf_logging.disable_progress_bar()
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # compressed-tensors' progress bars
        ours = load_model(ckpt).float()(input_ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()(input_ids).logits
    return {"max_abs_logit_diff": (ours - theirs).abs().max().item(), "max_abs_logit": theirs.abs().max().item()}


def llmc_versions(llmc_python: Path) -> dict:
    code = (
        "import json; from importlib.metadata import version as v; print(json.dumps({n: v(n) for n in "
        "('llmcompressor', 'compressed-tensors', 'torch', 'transformers', 'datasets')}))"
    )
    done = subprocess.run([str(llmc_python), "-c", code], capture_output=True, text=True, check=False)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()[-500:]}


def quantkit_versions() -> dict:
    from importlib.metadata import version

    names = ("quantkit", "compressed-tensors", "torch", "transformers")
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except Exception:  # compressed-tensors is a dev extra only
            out[name] = None
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(rows: list[Row], original: dict | None, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("library", "method", "time s", "peak RSS MB", "size MB", "perplexity", "+% vs orig", "KL mean"):
        table.add_column(col, justify="right" if col not in ("library", "method") else "left")
    table.add_column("top-1", justify="right")
    if original is not None:
        ppl = original.get("perplexity")
        table.add_row("original", "bf16", "-", "-", fmt(original.get("size_mb"), ".1f"), fmt(ppl, ".3f"), "0", "0", "1")
    for r in rows:
        if r.error:
            failed = "quantize failed" if r.safetensors_mb is None else "eval failed"
            cells = [fmt(r.seconds, ".1f"), fmt(r.peak_rss_mb, ".0f"), fmt(r.safetensors_mb, ".1f"), failed]
            table.add_row(r.library, f"{r.method} ({r.scheme})", *cells, "-", "-", "-", style="red")
            continue
        table.add_row(
            r.library,
            f"{r.method} ({r.scheme})",
            fmt(r.seconds, ".1f"),
            fmt(r.peak_rss_mb, ".0f"),
            fmt(r.safetensors_mb, ".1f"),
            fmt(r.perplexity, ".3f"),
            fmt(r.perplexity_change_pct, "+.2f"),
            fmt(r.kl_mean, ".4f"),
            fmt(r.top1_agreement, ".4f"),
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llmc-python", type=Path, default=None, help="python of the llm-compressor venv")
    parser.add_argument("--model", default="smollm2-135m", help="quantkit alias or float model directory")
    parser.add_argument("--methods", default="gptq,awq", help="comma list of gptq, awq")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="comma list of quantkit, llmcompressor")
    parser.add_argument("--calib", type=Path, default=None, help="existing `quantkit calibrate` file to use")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration windows (without --calib)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (without --calib)")
    parser.add_argument("--seed", type=int, default=0, help="calibration seed (without --calib)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--eval-windows", type=int, default=40, help="quantkit eval --max-windows")
    parser.add_argument("--llmc-dtype", default="auto", help="llm-compressor's model load dtype (auto: bf16)")
    parser.add_argument(
        "--llmc-no-pin-memory",
        action="store_true",
        help="without an accelerator, skip llm-compressor's pinning of cached activations (its AWQ fails otherwise)",
    )
    parser.add_argument("--work", type=Path, default=Path("/work/tmp/bench-llmc"), help="checkpoints and logs")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under --work (default: delete)")
    parser.add_argument(
        "--no-loader-check",
        action="store_true",
        help="skip comparing quantkit's loader with transformers' compressed-tensors decoding of each checkpoint",
    )
    parser.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
    args = parser.parse_args()

    from quantkit.model.resolve import resolve_model

    methods = [m for m in args.methods.split(",") if m]
    libraries = [lib for lib in args.libraries.split(",") if lib]
    for name in methods:
        if name not in METHODS:
            parser.error(f"unknown method {name!r}; use {', '.join(METHODS)}")
    for name in libraries:
        if name not in LIBRARIES:
            parser.error(f"unknown library {name!r}; use {', '.join(LIBRARIES)}")
    if "llmcompressor" in libraries and (args.llmc_python is None or not args.llmc_python.is_file()):
        parser.error(f"--llmc-python: the llm-compressor venv's python is required (got {args.llmc_python})")
    model_dir = resolve_model(args.model)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(Console().width, 130))

    calib = args.calib
    if calib is None:
        calib = work / f"calib-{args.num_samples}x{args.seq_len}-s{args.seed}.safetensors"
        windows = ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--seed", str(args.seed)]
        made = run(quantkit_cmd("calibrate", "--model", args.model, *windows, "-o", calib), work / "calibrate.log")
        if made.returncode != 0:
            sys.exit(f"quantkit calibrate failed:\n{tail(made.log)}")
    from quantkit.data.calibration import CalibrationSet

    calibration = CalibrationSet.load(calib)
    calib_info = {
        "file": str(calib),
        "windows": calibration.num_samples,
        "seq_len": calibration.seq_len,
        "fingerprint": calibration.fingerprint(),
        "source": calibration.metadata.get("source"),
        "params": json.loads(calibration.metadata.get("params", "{}")),
    }
    console.print(f"calibration: {calibration.num_samples} x {calibration.seq_len} ({calib_info['fingerprint']})")

    rows: list[Row] = []
    for method in methods:
        for library in libraries:
            scheme = METHODS[method].replace("W4", f"W{args.bits}").replace("g64", f"g{args.group_size}")
            out = work / f"{library}-{method}"
            shutil.rmtree(out, ignore_errors=True)
            console.print(f"[bold]{library} {method} ({scheme})[/]")
            row = Row(library, method, scheme, str(out))
            if library == "quantkit":
                q, info = quantize_quantkit(method, args.model, calib, out, args.bits, args.group_size)
                row.inner_seconds = info.get("seconds")
                row.extra["quantkit_peak_rss_mb"] = info.get("peak_rss_mb")  # its own measurement, for reference
            else:
                q, info = quantize_llmc(
                    method,
                    args.llmc_python,
                    model_dir,
                    calib,
                    out,
                    args.bits,
                    args.group_size,
                    args.llmc_dtype,
                    args.llmc_no_pin_memory and method == "awq",  # its GPTQ never pins
                )
                if info.get("patches"):
                    row.scheme += ", unpinned"
                row.inner_seconds = info.get("seconds")
                row.extra["llmc_info"] = info
                if info and not info["calibration"]["same_windows_fed"]:
                    console.print("[bold red]llm-compressor was not fed exactly the calibration windows[/]")
            row.seconds, row.peak_rss_mb = q.seconds, q.peak_rss_mb
            row.extra["quantize_log"] = q.log
            if q.returncode != 0:
                row.error = f"quantize failed ({q.returncode}): {tail(q.log, 15)}"
                console.print(f"[red]{row.error}[/]")
                rows.append(row)
                continue
            row.safetensors_mb = safetensors_mb(out)
            row.quantization_config = read_quant_config(out)
            e, result = evaluate_checkpoint(out, args.model, args.eval_windows)
            row.extra["eval_log"] = e.log
            if e.returncode != 0:
                row.error = f"eval failed ({e.returncode}): {tail(e.log, 15)}"
                console.print(f"[red]{row.error}[/]")
            else:
                row.eval = result
                row.perplexity = result["perplexity"]
                row.perplexity_change_pct = result["perplexity_change_pct"]
                row.kl_mean, row.kl_p99 = result["kl_mean"], result["kl_p99"]
                row.top1_agreement = result["top1_agreement"]
            if not args.no_loader_check:
                try:
                    row.extra["loader_check"] = loader_check(out, calibration.input_ids[:1, :64])
                except Exception as exc:  # report, do not lose the row: transformers may refuse a layout
                    row.extra["loader_check"] = {"error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)

    evaluated = next((r.eval for r in rows if r.eval), None)
    original = None
    if evaluated is not None:
        original = {
            "perplexity": evaluated["reference_perplexity"],
            "size_mb": safetensors_mb(model_dir),
            "tokens": evaluated["tokens"],
            "windows": evaluated["windows"],
        }
    tokens = f"{original['tokens']} held-out tokens" if original else "no evaluation"
    title = (
        f"quantkit vs llm-compressor on {args.model}: the same {calibration.num_samples} x {calibration.seq_len} "
        f"calibration windows ({calib_info['fingerprint']}), {tokens}; time and peak RSS of the whole subprocess"
    )
    console.print(render(rows, original, title))
    for r in rows:
        if r.error:
            last = [line for line in r.error.splitlines() if line.strip()][-1]
            log = r.extra.get("eval_log") or r.extra["quantize_log"]
            console.print(f"[red]{r.library} {r.method}: {escape(last.strip())}[/] (log: {log})", soft_wrap=True)
    table = Table(title="What each checkpoint records", title_justify="left")
    columns = ("library", "method", "format", "bits", "group", "symmetric", "actorder", "observer", "own s")
    for col in (*columns, "loader max|dlogit|"):
        table.add_column(col)
    for r in rows:
        w = weight_args(r.quantization_config)
        inner = r.inner_seconds.get("oneshot") if isinstance(r.inner_seconds, dict) else r.inner_seconds
        check = r.extra.get("loader_check") or {}
        diff = check.get("error") or fmt(check.get("max_abs_logit_diff"), ".2e")
        table.add_row(
            r.library,
            r.method,
            str((r.quantization_config or {}).get("format", "-")),
            str(w.get("num_bits", "-")),
            str(w.get("group_size", "-")),
            str(w.get("symmetric", "-")),
            str(w.get("actorder", "-")),
            str(w.get("observer", "-")),
            fmt(inner, ".1f"),
            diff if check else "-",
        )
    console.print(table)
    llmc_versions_ = llmc_versions(args.llmc_python) if "llmcompressor" in libraries else None
    console.print(f"quantkit venv: {quantkit_versions()}")
    if llmc_versions_ is not None:
        console.print(f"llm-compressor venv: {llmc_versions_}")
    if args.json:
        payload = {
            "model": args.model,
            "model_dir": str(model_dir),
            "calibration": calib_info,
            "eval_windows": args.eval_windows,
            "llmc_dtype": args.llmc_dtype,
            "original": original,
            "rows": [asdict(r) for r in rows],
            "versions": {"quantkit_venv": quantkit_versions(), "llmc_venv": llmc_versions_},
            "torch_threads": __import__("torch").get_num_threads(),
            "commands": COMMANDS,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        console.print(f"wrote {args.json}")
    if any(r.error for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
