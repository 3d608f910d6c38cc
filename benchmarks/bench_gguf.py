"""GGUF with llama.cpp itself: quantkit's Q4_0 export against llama.cpp's own Q4_0 (with and without imatrix).

Steps (every artifact under --work is reused when present; delete it to redo a step):

1. build llama-quantize, llama-perplexity and llama-imatrix from the llama.cpp sources vendored in the
   llama-cpp-python sdist (Release, -DGGML_NATIVE=ON -DLLAMA_CURL=OFF, into --build-dir, reused if built);
2. a float GGUF of the default model with llama.cpp's own convert_hf_to_gguf.py (--outtype bf16);
3. llama.cpp's Q4_0 of it with llama-quantize, token embedding kept in bf16 as quantkit's export keeps it, and
   the same with an importance matrix from llama-imatrix over the shipped calibration text;
4. quantkit: ``quantkit quantize <model> --method M --bits 4 --group-size 32`` (symmetric, so Q4_0), then
   :func:`quantkit.export.gguf.write_gguf`;
5. llama-perplexity of every file on quantkit's held-out evaluation text, same context size; a table and --json.

llama-perplexity scores the second half of each window only, so its figures are comparable with each other,
not with ``quantkit eval``'s.

    python -m benchmarks.bench_gguf --methods rtn,gptq --json bench_gguf.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

SDIST = Path("/work/tmp/dl/llama_cpp_python-0.3.36.tar.gz")
TOOLS = ("llama-quantize", "llama-perplexity", "llama-imatrix")
ASYMMETRIC_BY_DEFAULT = ("awq", "awq+gptq")  # quantkit methods given --sym so that they export to Q4_0
COMMANDS: list[str] = []  # every command run, in order, for the report


@dataclass(slots=True)
class Row:
    label: str
    file: str
    bytes: int
    bpw: float  # all tensors
    bpw_linear: float  # the decoder blocks' matrices
    perplexity: float
    perplexity_err: float
    chunks: int
    seconds_to_make: float | None  # None: reused from an earlier run


# --------------------------------------------------------------------------------------------------
# Running things
# --------------------------------------------------------------------------------------------------


def run(cmd: list, log: Path | None = None, cwd: Path | None = None) -> str:
    """Run ``cmd`` (recorded in COMMANDS), its output kept in ``log``; exits with the tail on failure."""
    text = shlex.join(str(c) for c in cmd)
    COMMANDS.append(text)
    print(f"$ {text}", flush=True)
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    if log is not None:
        log.write_text(output)
    if result.returncode != 0:
        sys.exit(f"command failed ({result.returncode}): {text}\n{output[-3000:]}")
    return output


def timed(make: Callable[[Path], object], target: Path) -> float | None:
    """``make(path)`` writes ``target`` under a temporary name, renamed once done (so an interrupted step is
    redone, not reused); seconds taken, None when ``target`` already existed."""
    if target.exists():
        print(f"reusing {target}", flush=True)
        return None
    partial = target.with_name(f"partial-{target.name}")  # same extension: llama-imatrix picks its format by it
    if partial.is_dir():
        shutil.rmtree(partial)
    partial.unlink(missing_ok=True)
    start = time.perf_counter()
    make(partial)
    partial.rename(target)
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------------
# llama.cpp
# --------------------------------------------------------------------------------------------------


def extract_sources(sdist: Path, src: Path) -> None:
    """The sdist's vendor/llama.cpp tree at ``src``."""
    tmp = src.with_name(src.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        tar.extractall(tmp, members=members, filter="data")
    inner = next(tmp.glob("*/vendor/llama.cpp"))
    src.parent.mkdir(parents=True, exist_ok=True)
    inner.rename(src)
    shutil.rmtree(tmp)


def build_llama_cpp(src: Path, build: Path, jobs: int) -> None:
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    run(["cmake", "-S", src, "-B", build, *flags], build.parent / f"{build.name}-configure.log")
    run(["cmake", "--build", build, f"-j{jobs}", "--target", *TOOLS], build.parent / f"{build.name}-build.log")


def ensure_llama_cpp(sdist: Path, src: Path, build: Path, jobs: int) -> dict[str, Path]:
    """Paths of the three tools and convert_hf_to_gguf.py, built only when missing."""
    if not (src / "convert_hf_to_gguf.py").is_file():
        extract_sources(sdist, src)
    tools = {name: build / "bin" / name for name in TOOLS}
    if all(path.is_file() for path in tools.values()):
        print(f"reusing llama.cpp tools in {build / 'bin'}", flush=True)
    else:
        build_llama_cpp(src, build, jobs)
    return {**tools, "convert": src / "convert_hf_to_gguf.py"}


# --------------------------------------------------------------------------------------------------
# The files
# --------------------------------------------------------------------------------------------------


def calibration_text(work: Path) -> Path:
    """quantkit's shipped calibration corpus as one text file (llama-imatrix reads plain text)."""
    from quantkit.data.sources import load_documents

    path = work / "calibration.txt"
    if not path.exists():
        path.write_text("\n\n".join(load_documents(None).texts))
    return path


def llama_cpp_q4_0(tools: dict[str, Path], float_gguf: Path, out: Path, imatrix: Path | None) -> None:
    cmd: list[str | Path] = [tools["llama-quantize"], "--token-embedding-type", "bf16", "--output-tensor-type", "bf16"]
    if imatrix is not None:
        cmd += ["--imatrix", imatrix]
    run([*cmd, float_gguf, out, "Q4_0"], out.with_name(out.name.removeprefix("partial-")).with_suffix(".log"))


def quantkit_q4_0(model: str, method: str, work: Path) -> tuple[Path, float | None]:
    """quantkit's checkpoint (W4 g32, symmetric) and its GGUF export (to a temporary name, then renamed);
    seconds for both, None when both were reused."""
    from quantkit.export.gguf import write_gguf
    from quantkit.export.source import open_export_source

    name = f"quantkit-{method.replace('+', '-')}-w4g32"
    ckpt, out = work / name, work / f"{name}.gguf"
    cmd = [sys.executable, "-m", "quantkit", "quantize", model, "--method", method, "--bits", "4"]
    cmd += ["--group-size", "32"] + (["--sym"] if method in ASYMMETRIC_BY_DEFAULT else [])
    quantize_seconds = timed(lambda path: run([*cmd, "-o", path], work / f"{name}-quantize.log"), ckpt)

    def export(path: Path) -> None:
        COMMANDS.append(f"write_gguf(open_export_source({str(ckpt)!r}), {str(path)!r})  # then renamed to {out.name}")
        summary = write_gguf(open_export_source(ckpt), path)
        print(f"quantkit export: {summary.tensor_types}; " + "; ".join(summary.notes), flush=True)

    export_seconds = timed(export, out)
    if quantize_seconds is None and export_seconds is None:
        return out, None
    return out, (quantize_seconds or 0) + (export_seconds or 0)


def bits_per_weight(path: Path) -> tuple[float, float]:
    """(all tensors, decoder-block matrices) in bits per weight."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    linear = [t for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]

    def bpw(items: list) -> float:
        return 8 * sum(int(t.n_bytes) for t in items) / sum(int(t.n_elements) for t in items)

    return bpw(tensors), bpw(linear)


def perplexity(tools: dict[str, Path], path: Path, text: Path, ctx: int, threads: int, chunks: int | None) -> tuple:
    """(ppl, +/-, chunks) from llama-perplexity."""
    cmd: list[str | Path] = [tools["llama-perplexity"], "-m", path, "-f", text, "-c", ctx, "-t", threads, "-b", ctx]
    if chunks is not None:
        cmd += ["--chunks", chunks]
    output = run(cmd, path.with_suffix(".ppl.log"))
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", output)
    counted = re.search(r"calculating perplexity over (\d+) chunks", output)
    if final is None or counted is None:
        sys.exit(f"no perplexity in the llama-perplexity output of {path}:\n{output[-2000:]}")
    return float(final[1]), float(final[2]), int(counted[1])


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="float model (alias or HF directory)")
    parser.add_argument("--methods", default="gptq", help="quantkit methods, comma-separated (rtn, gptq, awq+gptq)")
    parser.add_argument("--work", type=Path, default=Path("/work/tmp/bench-gguf"), help="artifacts directory")
    parser.add_argument("--sdist", type=Path, default=SDIST, help="llama-cpp-python sdist with vendor/llama.cpp")
    parser.add_argument("--llama-src", type=Path, default=Path("/work/tmp/llama-src/llama.cpp"))
    parser.add_argument("--build-dir", type=Path, default=Path("/work/tmp/llama.cpp-build"))
    parser.add_argument("--ctx", type=int, default=512, help="context size of llama-perplexity and llama-imatrix")
    parser.add_argument("--chunks", type=int, default=None, help="llama-perplexity chunks (default: the whole text)")
    parser.add_argument("--imatrix-chunks", type=int, default=128, help="as quantkit's 128 calibration windows")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=None, help="write the rows and commands here")
    return parser.parse_args(argv)


Made = dict[str, tuple[Path, float | None]]  # label -> (GGUF file, seconds to make it, None when reused)


def llama_cpp_files(args: argparse.Namespace, tools: dict[str, Path], model_dir: Path) -> Made:
    work = args.work
    float_gguf, q4, q4_imat = work / "float-bf16.gguf", work / "llamacpp-q4_0.gguf", work / "llamacpp-q4_0-imat.gguf"
    imatrix = work / "imatrix.gguf"
    convert = [sys.executable, tools["convert"], model_dir, "--outtype", "bf16", "--outfile"]
    files: Made = {"float bf16 (convert_hf_to_gguf)": (float_gguf, timed(lambda p: run([*convert, p]), float_gguf))}
    files["llama.cpp Q4_0"] = (q4, timed(lambda p: llama_cpp_q4_0(tools, float_gguf, p, None), q4))
    imat_cmd = [tools["llama-imatrix"], "-m", float_gguf, "-f", calibration_text(work)]
    imat_cmd += ["-c", args.ctx, "-b", args.ctx, "--chunks", args.imatrix_chunks, "-t", args.threads, "-o"]
    imat_seconds = timed(lambda p: run([*imat_cmd, p], work / "imatrix.log"), imatrix)
    q4i_seconds = timed(lambda p: llama_cpp_q4_0(tools, float_gguf, p, imatrix), q4_imat)
    files["llama.cpp Q4_0 + imatrix"] = (q4_imat, None if q4i_seconds is None else q4i_seconds + (imat_seconds or 0))
    return files


def quantkit_files(args: argparse.Namespace) -> Made:
    files: Made = {}
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        files[f"quantkit {method} W4 g32 -> Q4_0"] = quantkit_q4_0(args.model, method, args.work)
    return files


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SmolLM2-135M-Instruct in llama.cpp: perplexity on the held-out Austen text")
    for column in ("file", "size (bytes)", "bpw all", "bpw blk", "perplexity", "chunks", "make (s)"):
        table.add_column(column, justify="left" if column == "file" else "right")
    for r in rows:
        made = "reused" if r.seconds_to_make is None else f"{r.seconds_to_make:.0f}"
        ppl = f"{r.perplexity:.4f} ± {r.perplexity_err:.4f}"
        table.add_row(r.label, f"{r.bytes:,}", f"{r.bpw:.3f}", f"{r.bpw_linear:.3f}", ppl, str(r.chunks), made)
    Console(width=None if sys.stdout.isatty() else 140).print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from quantkit.data.sources import DEFAULT_EVALUATION
    from quantkit.model.resolve import resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    tools = ensure_llama_cpp(args.sdist, args.llama_src, args.build_dir, args.threads)
    files = llama_cpp_files(args, tools, resolve_model(args.model)) | quantkit_files(args)
    rows = []
    for label, (path, seconds) in files.items():
        ppl, err, chunks = perplexity(tools, path, DEFAULT_EVALUATION, args.ctx, args.threads, args.chunks)
        bpw, bpw_linear = bits_per_weight(path)
        rows.append(Row(label, str(path), path.stat().st_size, bpw, bpw_linear, ppl, err, chunks, seconds))
    print_table(rows)
    if args.json is not None:
        report = {"model": args.model, "ctx": args.ctx, "eval_text": str(DEFAULT_EVALUATION), "commands": COMMANDS}
        report["rows"] = [asdict(r) for r in rows]
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
