"""The measurements of tools/gpu_check.sh (issue 37), one subcommand each, each writing one JSON object whose
``figures`` (a flat mapping of short names to values) the summary table prints.

    python -m tools.gpu_check env OUT.json
    python -m tools.gpu_check imports OUT.json --expect DIR [--pip-rc N]
    python -m tools.gpu_check engines CHECKPOINT OUT.json [--dtype bfloat16]
    python -m tools.gpu_check parity MODEL OUT.json [--prompts 8] [--tokens 32] [--dtype float16]
    python -m tools.gpu_check decode CHECKPOINT OUT.json [--batches 1 16 64] [--tokens 64] [--prompt-len 64]
    python -m tools.gpu_check gptq MODEL OUTPUT_DIR OUT.json [--device cuda] [--full-layers 32] ...
    python -m tools.gpu_check sweep OUT.json [--seconds 45]
    python -m tools.gpu_check bench-figures BENCH.json OUT.json
    python -m tools.gpu_check junit REPORT.xml OUT.json
    python -m tools.gpu_check timed OUT.json [--size DIR] -- COMMAND ...

The heavy ones live in their own modules: ``engines``/``parity`` in gpu_check_engine, ``decode`` in
gpu_check_decode, ``gptq`` in gpu_check_gptq, ``sweep``/``bench-figures`` in gpu_check_bench. On a machine without
CUDA they run on the CPU in float32 (the script's ``--dry-run``); ``sweep`` needs a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from tools.gpu_check_common import write

PACKAGES = ("torch", "triton", "transformers", "safetensors", "pydantic", "typer", "pytest-xdist", "pytest-timeout")


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def env(out: Path) -> None:
    import torch

    versions = {name: _version(name) for name in PACKAGES}
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp"))
    disk = shutil.disk_usage(work if work.exists() else "/")
    figures: dict = {"device": "cpu", "python": platform.python_version()}
    figures |= {k: v for k, v in versions.items() if k in ("torch", "triton", "transformers", "pydantic")}
    figures["disk_free_gb"] = round(disk.free / 1e9, 1)
    figures["ram_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    figures["cpus"] = os.cpu_count()
    data: dict = {"versions": versions, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures |= {
            "device": torch.cuda.get_device_name(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "memory_gb": round(props.total_memory / 1e9, 1),
            "multiprocessors": props.multi_processor_count,
            "torch_cuda": torch.version.cuda,
        }
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"]
            figures["driver_clocks"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            figures["driver_clocks"] = str(exc)
    write(out, data | {"figures": figures})


def imports(out: Path, expect: Path, pip_rc: int) -> None:
    """quantkit (from ``expect``: the non-editable install, or the tree when that failed), its CLI and runtime."""
    seconds = {}
    for module in (
        "pydantic",
        "quantkit",
        "quantkit.cli",
        "quantkit.runtime.engine",
        "quantkit.runtime.kernels.backend",
    ):
        start = time.perf_counter()
        importlib.import_module(module)
        seconds[module] = round(time.perf_counter() - start, 2)
    import quantkit
    from quantkit.runtime.kernels.backend import triton_available

    where = Path(quantkit.__file__).resolve().parent.parent
    help_rc = subprocess.run([sys.executable, "-m", "quantkit", "--help"], capture_output=True, timeout=120).returncode
    figures = {
        "quantkit_install": "ok" if pip_rc == 0 else f"failed (pip rc {pip_rc}); the tree imports",
        "imported_from": str(where),
        "import_cli_s": seconds["quantkit.cli"],
        "cli_help_rc": help_rc,
        "triton_available": triton_available(),
        "pydantic": _version("pydantic"),
    }
    write(out, {"figures": figures, "import_seconds": seconds})
    if where != expect.resolve() or help_rc != 0:
        raise SystemExit(f"quantkit imported from {where}, expected {expect}; or `quantkit --help` failed ({help_rc})")


def junit(report: Path, out: Path) -> None:
    """A pytest junit XML report as counts and the names of the tests that failed."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    figures = {"passed": passed, "failed": counts["failures"] + counts["errors"], "skipped": counts["skipped"]}
    if failed:
        figures["first_failures"] = ", ".join(f.rsplit(".", 1)[-1] for f in failed[:6])
    write(out, counts | {"passed": passed, "failed": failed, "figures": figures})


def timed(out: Path, command: list[str], size: Path | None) -> int:
    start = time.perf_counter()
    rc = subprocess.run(command, check=False).returncode
    seconds = time.perf_counter() - start
    figures: dict = {"seconds": round(seconds, 1), "rc": rc}
    if size is not None and size.is_dir():
        total = sum(f.stat().st_size for f in size.rglob("*") if f.is_file())
        figures |= {"mb": round(total / 1e6, 1), "mb_per_s": round(total / 1e6 / seconds, 1)}
    write(out, {"command": command, "figures": figures})
    return rc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env").add_argument("out", type=Path)
    p = sub.add_parser("imports")
    p.add_argument("out", type=Path)
    p.add_argument("--expect", type=Path, required=True)
    p.add_argument("--pip-rc", type=int, default=0)
    p = sub.add_parser("engines")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p = sub.add_parser("parity")
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--dtype", default="float16")
    p = sub.add_parser("decode")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p = sub.add_parser("gptq")
    p.add_argument("model", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--full-layers", type=int, default=32, help="estimate the time of a model this deep")
    p = sub.add_parser("sweep")
    p.add_argument("out", type=Path)
    p.add_argument("--seconds", type=float, default=45.0, help="stop after this long with what was measured")
    p = sub.add_parser("bench-figures")
    p.add_argument("bench", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("junit")
    p.add_argument("report", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("timed")
    p.add_argument("out", type=Path)
    p.add_argument("--size", type=Path, help="report the size of this directory afterwards")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []  # timed's command
    args = _parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.command == "env":
        env(args.out)
    elif args.command == "imports":
        imports(args.out, args.expect, args.pip_rc)
    elif args.command in ("engines", "parity"):
        from tools import gpu_check_engine

        if args.command == "engines":
            gpu_check_engine.engines(args.checkpoint, args.out, args.dtype, args.prompts, args.tokens)
        else:
            gpu_check_engine.parity(args.model, args.out, args.prompts, args.tokens, args.dtype)
    elif args.command == "decode":
        from tools.gpu_check_decode import decode

        decode(args.checkpoint, args.out, args.batches, args.tokens, args.prompt_len, args.dtype)
    elif args.command == "gptq":
        from tools.gpu_check_gptq import gptq

        gptq(args)
    elif args.command == "sweep":
        from tools.gpu_check_bench import sweep

        sweep(args.out, args.seconds)
    elif args.command == "bench-figures":
        from tools.gpu_check_bench import bench_figures

        bench_figures(args.bench, args.out)
    elif args.command == "junit":
        junit(args.report, args.out)
    else:
        if not command:
            raise SystemExit("timed needs a command after --, e.g. timed OUT.json -- python -m tools.random_model ...")
        return timed(args.out, command, args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
