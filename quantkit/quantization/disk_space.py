"""Free space, checked before any work: the checkpoint, plus the work directory beside it while it is written."""

from __future__ import annotations

import shutil
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.format.tensors import storage_bits
from quantkit.model.source_weights import config_json
from quantkit.quantization.job import QuantizeJob

_MARGIN = 1.1
_SPILL_BYTES = 4  # the spilled MLP inputs are float32; hidden states are stored in the model's dtype


def expected_bytes(job: QuantizeJob) -> dict[str, int]:
    """About how much the run writes: the checkpoint, and the work directory (finished blocks, the next block's
    input twice while it is replaced, with tuning or a head refit the float model's too, the spilled MLP
    inputs)."""
    scale_bits = job.storage.itemsize * 8
    quantized = {f"{name}.weight": s for name, s in job.assignment.schemes.items() if s is not None}
    linear_bits = 0
    for name, scheme in quantized.items():
        weights = job.weights.in_features([name.removesuffix(".weight")])
        k = next(iter(weights.values()))
        n = job.weights.stored_bytes(name) // (k * job.storage.itemsize)
        linear_bits += storage_bits(scheme, n, k, scale_bits)
    dense = sum(job.weights.stored_bytes(t) for t in job.weights.names() if t not in quantized)
    checkpoint = linear_bits // 8 + dense
    work = checkpoint
    if job.calibration is not None:
        config = config_json(job.source)
        tokens = job.calibration.input_ids.numel()
        streams = 2 if job.steps.keeps_float_path else 1  # the float model's activations beside the quantized
        hidden = 2 * streams * int(config["hidden_size"]) * job.storage.itemsize  # the current input and the next
        # the widest down_proj input (Qwen3.5-MoE's config.json has no dense intermediate_size, only the experts')
        widths = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
        work += tokens * (hidden + max(int(config.get(key) or 0) for key in widths) * _SPILL_BYTES)
    return {"checkpoint": checkpoint, "work directory": work}


def check_free_space(job: QuantizeJob) -> None:
    """QuantkitError with the numbers when the output's file system cannot hold the run."""
    parent = _existing_parent(job.output)
    sizes = expected_bytes(job)
    need = int(sum(sizes.values()) * _MARGIN)
    free = shutil.disk_usage(parent).free
    if free < need:
        parts = ", ".join(f"{k} ~{v / 1e6:.0f} MB" for k, v in sizes.items())
        raise QuantkitError(
            f"{parent} has {free / 1e6:.0f} MB free and this run needs about {need / 1e6:.0f} MB ({parts}); "
            f"free {(need - free) / 1e6:.0f} MB or write the output elsewhere"
        )


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path
