"""Where tensors are computed: the ``--device`` rule of every command (quantize, sensitivity, eval, serve, bench,
recipes), written once.

``auto`` is CUDA when torch sees a CUDA device, else the CPU; ``cuda`` (or ``cuda:N``) without one is a user error
that names the problem and the fix. Float64: the CPU and CUDA compute in it; a device without it (Apple's MPS) gets
the solvers' float64 reductions (GPTQ's loss, the Hessian-weighted error) on the CPU instead, through
:func:`float64_device`. quantkit offers no ``mps`` choice today; that rule is what keeps the solvers correct there.
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError

DEVICES = ("auto", "cpu", "cuda")  # "cuda:N" picks one GPU of several
DEFAULT_DEVICE = "auto"
DEVICE_HELP = "Where to compute: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N."
_NO_FLOAT64 = frozenset({"mps"})  # device types without float64 arithmetic


def resolve_device(name: str) -> torch.device:
    """The device ``name`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) stands for on this machine.

    Raises QuantkitError for another name, or for CUDA when torch sees no CUDA device (with the reason: a CPU-only
    build of torch, or no visible GPU) and what to do instead.
    """
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    index = name.partition(":")[2]
    if not torch.cuda.is_available():
        raise QuantkitError(f"device '{name}' is not available: {_why_no_cuda()}; use device cpu or auto instead")
    if index and int(index) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise QuantkitError(f"device '{name}' does not exist: torch sees {count} CUDA device(s), cuda:0..{count - 1}")
    return torch.device(name)


def check_device_name(name: object) -> str:
    """``name`` when it is a device name quantkit takes (whether this machine has it is not checked), else a
    QuantkitError that lists them. Recipes are checked this way, so one written for a GPU validates anywhere."""
    kind, _, index = str(name).partition(":")
    if not isinstance(name, str) or (name not in DEVICES and (kind != "cuda" or not index.isdigit())):
        raise QuantkitError(f"device {name!r} is invalid; use one of {', '.join(DEVICES)} (or cuda:N)")
    return name


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch on a machine with an "
            "NVIDIA GPU to use one)"
        )
    return "torch sees no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)"


def supports_float64(device: torch.device) -> bool:
    """Whether ``device`` computes in float64 (CPU and CUDA do; MPS does not)."""
    return device.type not in _NO_FLOAT64


def float64_device(device: torch.device) -> torch.device:
    """Where float64 work for tensors on ``device`` runs: the device itself, or the CPU where it has no float64."""
    return device if supports_float64(device) else torch.device("cpu")


def peak_device_memory_mb(device: torch.device) -> float | None:
    """The peak memory torch allocated on a CUDA ``device`` so far, in MB (10^6 bytes); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 1e6
