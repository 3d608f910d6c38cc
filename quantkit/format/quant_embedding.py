"""QuantEmbedding: an embedding over a checkpoint's quantized tensors (compressed-tensors ``pack-quantized``, the
[vocab, hidden] table packed along hidden as a Linear's weight is), dequantized once and looked up in float.

vLLM dequantizes only the rows it gathers; quantkit's loader and runtime are for evaluation and CPU serving of
small models, where one dense table is the simple and fast choice. :func:`dense_embedding` gives that table from
checkpoint tensors (the runtime's path)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import linear_parts, read_linear


def dense_embedding(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme, dtype: torch.dtype):
    """The dequantized [vocab, hidden] table of the quantized embedding ``prefix`` among ``tensors``."""
    return read_linear(tensors, prefix, scheme).dequantize(dtype)


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
