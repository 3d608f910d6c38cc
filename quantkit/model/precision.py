"""The precision of the block forward passes that make the calibration activations (``--compute-dtype``).

float32 computes every product of a block in float32. bfloat16 runs the products (the linears, attention) under
autocast: inputs and weights rounded to bfloat16, accumulated in float32, as llm-compressor and GPTQModel run the
model in its own dtype; on a CPU with AVX512-BF16 (or a GPU's tensor cores) those products are several times
faster. Norms, residual adds, GPTQ's Hessians and every sum stay float32; the float targets' moments are
bfloat16 products of differences added to float32 sums (``StageMoments`` in
:mod:`quantkit.quantization.methods.float_targets`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from quantkit.errors import QuantkitError

COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_COMPUTE_DTYPE = "float32"
COMPUTE_DTYPE_HELP = (
    "Precision of the block forward passes that make the calibration activations: float32, or bfloat16 (products "
    "in bfloat16 with float32 accumulation, as peers run a bfloat16 model; several times faster on CPUs with "
    "AVX512-BF16 and on GPUs). Hessians and the float targets' sums stay float32."
)


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--compute-dtype`` name; an unknown name is refused with the choices."""
    try:
        return COMPUTE_DTYPES[name]
    except KeyError:
        raise QuantkitError(f"unknown --compute-dtype '{name}'; use one of {', '.join(COMPUTE_DTYPES)}") from None


def forward_precision(dtype: torch.dtype, device: torch.device) -> AbstractContextManager[object]:
    """A context in which a block's products run in ``dtype`` on ``device`` (float32: nothing changes)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def products_autocast(device: torch.device) -> bool:
    """Whether products on ``device`` are under :func:`forward_precision`'s autocast right now."""
    return torch.is_autocast_enabled(device.type)
