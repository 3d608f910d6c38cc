"""Export an in-memory model whose Linears were quantized (by name) as a ``pack-quantized`` checkpoint,
checking that every quantized module has the scheme its ``quantization_config`` gives it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.format.quantization_config import QuantizationLayout, parse_quantization_config
from quantkit.format.scheme import QuantizedWeight
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter

# --------------------------------------------------------------------------------------------------
# Whole-model export
# --------------------------------------------------------------------------------------------------


def _check_layout(model: torch.nn.Module, quantized: Mapping[str, QuantizedWeight], layout: QuantizationLayout) -> None:
    """Every quantized Linear has the scheme the config gives it, and every targeted Linear is quantized."""
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            if name in quantized:
                raise QuantkitError(f"{name!r} is not a Linear of this model")
            continue
        scheme = layout.scheme_for(name, [c.__name__ for c in type(module).__mro__])
        if name in quantized and scheme != quantized[name].scheme:
            raise QuantkitError(
                f"{name!r} was quantized with {quantized[name].scheme.name} but quantization_config gives it "
                f"{scheme.name if scheme else 'no scheme'}; fix the config targets"
            )
        if name not in quantized and scheme is not None:
            raise QuantkitError(f"quantization_config targets {name!r} but no quantized weight was given for it")
    unknown = set(quantized) - {name for name, _ in model.named_modules()}
    if unknown:
        raise QuantkitError(f"quantized weights given for modules this model does not have: {sorted(unknown)}")


def save_quantized_model(
    model: torch.nn.Module,
    quantized: Mapping[str, QuantizedWeight],
    quantization_config: Mapping[str, Any],
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    copy_files: Sequence[Path] = (),
    max_shard_bytes: int = 2 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Export ``model`` with the Linears named in ``quantized`` replaced by packed tensors.

    Float tensors and scales are stored in ``dtype``. Every quantized module must be the one
    ``quantization_config`` assigns its scheme to (checked), and tied weights are written once.
    """
    _check_layout(model, quantized, parse_quantization_config(quantization_config))

    config = model.config.to_dict() if hasattr(model, "config") else {}
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)
    skip = {f"{name}.weight" for name in quantized}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    with ShardedWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        for key, tensor in model.state_dict(keep_vars=False).items():
            if key in skip:
                continue
            ident = (tensor.data_ptr(), tuple(tensor.shape))
            if ident in seen and tensor.numel():  # tied weight: stored once, under its first name
                continue
            seen.add(ident)
            writer.add({key: tensor.to(dtype) if tensor.is_floating_point() else tensor})
        for name, qw in quantized.items():
            writer.add(linear_tensors(name, qw, dtype))
        return writer.finalize(config, copy_files, quantization_config)
