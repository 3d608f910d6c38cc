"""Lazy access to a model's safetensors shards, and a skeleton model whose blocks are loaded one at a time.

Only the tensors asked for are read, so a model larger than RAM can be processed block by block.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.quant_linear import materialize_meta_buffers, shard_files


class SourceWeights:
    """Tensor name -> shard, read on demand (in the stored dtype)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = shard_files(path)
        self._stack = ExitStack()
        self._handles = [self._stack.enter_context(safe_open(str(f), framework="pt")) for f in self.files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118 (safe_open API)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SourceWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise QuantkitError(f"tensor '{name}' is missing from the checkpoint at {self.path}")
        return self._where[name].get_tensor(name)

    def storage_dtype(self) -> torch.dtype:
        """The dtype of the model's float weights (the checkpoint keeps it for unquantized tensors)."""
        for name in self._where:
            if name.endswith(".weight"):
                tensor = self.get(name)
                if tensor.is_floating_point():
                    return tensor.dtype
        raise QuantkitError(f"no floating-point weight found in {self.path}")

    def fingerprint(self) -> str:
        """Identity of the weights: config plus every shard's safetensors header (names, dtypes, offsets) and size."""
        digest = hashlib.sha256((self.path / "config.json").read_bytes())
        for f in self.files:
            with f.open("rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                digest.update(fh.read(header_len))
            digest.update(str(f.stat().st_size).encode())
        return digest.hexdigest()[:16]


def build_skeleton(path: Path) -> nn.Module:
    """The model built from config.json on the meta device: no memory for weights until loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    materialize_meta_buffers(model)  # rotary inv_freq and other non-persistent buffers, on CPU
    return model.eval()


def load_module(module: nn.Module, prefix: str, weights: SourceWeights, dtype: torch.dtype = torch.float32) -> None:
    """Load ``module``'s parameters and persistent buffers from the shards (cast to ``dtype``)."""
    state = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        stored = weights.get(f"{prefix}.{name}")
        state[name] = stored.to(dtype) if stored.is_floating_point() else stored
        if tuple(stored.shape) != tuple(tensor.shape):
            raise QuantkitError(
                f"{prefix}.{name}: checkpoint shape {tuple(stored.shape)} != model {tuple(tensor.shape)}"
            )
    module.load_state_dict(state, strict=True, assign=True)


def release_module(module: nn.Module) -> None:
    """Free a module's weights by moving them back to the meta device."""
    module.to(device="meta")


def config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
