"""Shared by the measurements of tools/gpu_check.sh: writing a result file, the step's deadline, timing on the device
(standard library at import: torch is imported only by the functions that time)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path


def write(path: Path, data: dict) -> None:
    """Atomically (the scheduler merges result files while the step still runs: it never sees half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def seconds_left() -> float:
    """Until the scheduler kills this step (``GPU_CHECK_DEADLINE``, epoch seconds); infinite when run by hand."""
    deadline = os.environ.get("GPU_CHECK_DEADLINE")
    return float(deadline) - time.time() if deadline else math.inf


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def elapsed_s(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes on the device: CUDA events around it on a GPU, a synchronized wall clock elsewhere."""
    import torch

    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s: bytes read + written by a large copy, median of 10 after a warm-up."""
    import torch

    cuda = torch.cuda.is_available()
    n = (1 << 30) if cuda else (64 << 20)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda" if cuda else "cpu")  # never zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = sorted(elapsed_s(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * n / times[len(times) // 2]
