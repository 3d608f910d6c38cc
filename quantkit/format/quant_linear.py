"""QuantLinear: a Linear over a checkpoint's quantized tensors that dequantizes its weight on the fly and
quantizes its input as the serving kernel does (:mod:`quantkit.format.input_quant`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.format.input_quant import fake_quantize_input
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import INPUT_GLOBAL, INPUT_SCALE, linear_parts, linear_tensors, read_linear


class QuantLinear(nn.Module):
    """A Linear whose weight is held as the compressed-tensors tensors of its scheme's format.

    The buffers are named like the checkpoint tensors, so ``load_state_dict`` takes a checkpoint's
    tensors directly. ``forward`` dequantizes the weight on every call (plain torch); set ``cache_weight=True``
    to keep the dense weight after the first call (uses dense memory). A scheme with quantized inputs quantizes
    and dequantizes ``x`` first, with the checkpoint's static input scale where it has one.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        bias: bool = False,
        scale_dtype: torch.dtype = torch.bfloat16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cache_weight: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.cache_weight = cache_weight
        self._cached: torch.Tensor | None = None
        for part in linear_parts(scheme, out_features, in_features, scale_dtype):
            self.register_buffer(part.name, torch.zeros(part.shape, dtype=part.dtype, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def from_quantized(
        cls, qw: QuantizedWeight, bias: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.bfloat16
    ) -> QuantLinear:
        """Build from an in-memory quantized weight (scales cast to ``scale_dtype`` where the format keeps them in
        the model's dtype)."""
        n, k = qw.shape
        dtype = bias.dtype if bias is not None else torch.float32
        layer = cls(k, n, qw.scheme, bias=bias is not None, scale_dtype=scale_dtype, dtype=dtype)
        state = linear_tensors("", qw, scale_dtype)
        if bias is not None:
            state["bias"] = bias.detach().clone()
        layer.load_state_dict(state, strict=True)
        return layer

    def quantized_weight(self) -> QuantizedWeight:
        """The quantized weight held by this layer."""
        return read_linear(dict(self.named_buffers(recurse=False)), "", self.scheme)

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized [out, in] weight: ``(q - zero) * scale`` computed exactly in float32, then cast.

        Casting once afterwards equals computing in a 16-bit dtype: the product of a small integer and a
        16-bit scale is exact in float32, so both round once.
        """
        if self._cached is not None and self._cached.dtype == dtype:
            return self._cached
        device = next(self.buffers()).device
        weight = self.quantized_weight().dequantize(dtype).to(device)
        if self.cache_weight:
            self._cached = weight
        return weight

    def clear_cache(self) -> None:
        self._cached = None

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self._cached = None  # new buffers invalidate the dense copy
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts = self.scheme.activations
        if acts is not None:
            static = getattr(self, INPUT_SCALE, None)
            x = fake_quantize_input(x, acts, getattr(self, INPUT_GLOBAL, static))
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"
