"""The precision of the block forward passes that make the calibration activations (``--compute-dtype``).

float32 computes every product of a block in float32. bfloat16 runs the products (the linears, attention) under
autocast: inputs and weights rounded to bfloat16, accumulated in float32, as llm-compressor and GPTQModel run the
model in its own dtype; on a CPU with AVX512-BF16 (or a GPU's tensor cores) those products are several times
faster. Norms, residual adds, GPTQ's Hessians and every sum stay float32; the float targets' moments are
bfloat16 products of differences added to float32 sums (``StageMoments`` in
:mod:`quantkit.quantization.methods.float_targets`).

Without those instructions (an AVX2-only CPU) torch emulates bfloat16 products, and a recipe that chose bfloat16
for speed runs many times slower than in float32. ``auto`` is therefore the portable choice: bfloat16 where the
device computes it natively, float32 elsewhere; it is resolved once per run, so the run's fingerprint records the
precision the blocks were really solved in and ``--resume`` on another machine never mixes the two.
"""

from __future__ import annotations

import re
import warnings
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO_COMPUTE_DTYPE = "auto"
COMPUTE_DTYPE_NAMES = (*COMPUTE_DTYPES, AUTO_COMPUTE_DTYPE)
DEFAULT_COMPUTE_DTYPE = "float32"
COMPUTE_DTYPE_HELP = (
    "Precision of the block forward passes that make the calibration activations: float32, bfloat16 (products "
    "in bfloat16 with float32 accumulation, as peers run a bfloat16 model; several times faster on CPUs with "
    "AVX512-BF16 or AMX and on GPUs, many times slower on CPUs without them), or auto (bfloat16 where the device "
    "has it natively, else float32). Hessians and the float targets' sums stay float32."
)
# The CPU flags (Linux's /proc/cpuinfo) of instructions that multiply bfloat16: x86's AVX512-BF16 and AMX, and
# Arm's BF16 extension.
_NATIVE_BF16_FLAGS = re.compile(r"\b(avx512_bf16|amx_bf16|bf16)\b")


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved ``--compute-dtype`` name; an unknown name is refused with the choices."""
    try:
        return COMPUTE_DTYPES[name]
    except KeyError:
        raise QuantkitError(f"unknown --compute-dtype '{name}'; use one of {', '.join(COMPUTE_DTYPE_NAMES)}") from None


def check_compute_dtype_name(name: str) -> None:
    """Refuse an unknown ``--compute-dtype`` name (``auto`` included in the choices)."""
    if name != AUTO_COMPUTE_DTYPE:
        compute_dtype(name)


def resolve_compute_dtype(name: str, device: torch.device) -> str:
    """The precision ``name`` stands for on ``device``: ``auto`` becomes bfloat16 where the device multiplies it
    natively, else float32. An explicit bfloat16 on a CPU without the instructions is kept, with one warning."""
    check_compute_dtype_name(name)
    native = native_bfloat16(device)
    if name == AUTO_COMPUTE_DTYPE:
        return "bfloat16" if native else "float32"
    if name == "bfloat16" and not native:
        warnings.warn(
            f"--compute-dtype bfloat16 on a {device.type} without bfloat16 instructions (no AVX512-BF16 or AMX): "
            "its products are emulated and many times slower than float32; use --compute-dtype auto or float32",
            stacklevel=2,
        )
    return name


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware (a CUDA GPU that supports it, or a CPU with the flags)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return cpu_has_bfloat16_instructions()
    return False


@cache
def cpu_has_bfloat16_instructions(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bfloat16 multiply instructions, from the kernel's CPU flags; where there are none to
    read (not Linux), oneDNN's own answer of whether it has a bfloat16 path."""
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _NATIVE_BF16_FLAGS.search(flags) is not None


def forward_precision(dtype: torch.dtype, device: torch.device) -> AbstractContextManager[object]:
    """A context in which a block's products run in ``dtype`` on ``device`` (float32: nothing changes)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def products_autocast(device: torch.device) -> bool:
    """Whether products on ``device`` are under :func:`forward_precision`'s autocast right now."""
    return torch.is_autocast_enabled(device.type)
