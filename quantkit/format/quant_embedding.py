"""QuantEmbedding: an embedding over a checkpoint's quantized tensors (compressed-tensors ``pack-quantized``, the
[vocab, hidden] table packed along hidden as a Linear's weight is), dequantized once and looked up in float.

vLLM dequantizes only the rows it gathers; quantkit's loader and runtime are for evaluation and CPU serving of
small models, where one dense table is the simple and fast choice. :func:`dense_embedding` gives that table from
checkpoint tensors (the runtime's path, and the loader's for an unpacked table: int8 codes stored as ``weight``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import QUANTIZED_PARTS, SCALE, linear_parts, read_linear

if TYPE_CHECKING:
    from quantkit.format.quantization_config import QuantizationLayout


def dense_embedding(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme, dtype: torch.dtype):
    """The dequantized [vocab, hidden] table of the quantized embedding ``prefix`` among ``tensors``."""
    return read_linear(tensors, prefix, scheme).dequantize(dtype)


def densify_embeddings(
    model: nn.Module, layout: QuantizationLayout, state: dict[str, torch.Tensor], *, unpacked_only: bool = False
) -> None:
    """Each quantized embedding's tensors in ``state`` replaced by its dense table, in the module's dtype (the
    runtime looks rows up in one). ``unpacked_only``: only unpacked tables, whose int8 codes are named ``weight`` as
    the module's own table is (quantkit's loader keeps a packed one in a QuantEmbedding)."""
    for name, module in model.named_modules():
        scheme = layout.scheme_for(name, ["Embedding"]) if isinstance(module, nn.Embedding) else None
        if scheme is None or (unpacked_only and not scheme.unpacked):
            continue
        stored = state.get(f"{name}.weight")
        if stored is not None and stored.is_floating_point():
            continue  # a float table: nothing to dequantize
        table = dense_embedding(state, name, scheme, module.weight.dtype).to(state[f"{name}.{SCALE}"].device)
        for part in QUANTIZED_PARTS:
            state.pop(f"{name}.{part}", None)
        state[f"{name}.weight"] = table


class QuantEmbedding(nn.Module):
    """An embedding whose table is held as the checkpoint's quantized tensors (buffers named like them)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        scheme: QuantScheme,
        scale_dtype: torch.dtype = torch.bfloat16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scheme, self.dtype = num_embeddings, embedding_dim, scheme, dtype
        self._cached: torch.Tensor | None = None
        for part in linear_parts(scheme, num_embeddings, embedding_dim, scale_dtype):
            self.register_buffer(part.name, torch.zeros(part.shape, dtype=part.dtype, device=device))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (computed once; new buffers invalidate it)."""
        if self._cached is None:
            buffers = dict(self.named_buffers(recurse=False))
            self._cached = dense_embedding(buffers, "", self.scheme, self.dtype)
        return self._cached

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self._cached = None
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme.name}"
