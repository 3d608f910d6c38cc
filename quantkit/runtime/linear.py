"""The runtime's Linear: ``y = x W^T + b`` with W dense or held as a checkpoint's quantized tensors, and the input
quantized as the serving kernel quantizes it.

A quantized layer (``quantize(scheme)`` on the meta device, before loading) holds the tensors of its scheme's
compressed-tensors format under their checkpoint names (:func:`quantkit.format.tensors.linear_parts`, the one
description of them) and is ``prepare``-d either by keeping an integer weight-only (``pack-quantized``) layer packed
for the Triton ``quant_matmul`` kernel (4/8 bits on CUDA), or by dequantizing the weight once into the compute dtype
(every other format, and the torch backend). A scheme with quantized inputs (W8A8, FP8, NVFP4, MX ...) quantizes and
dequantizes ``x`` before the matmul through :func:`quantkit.format.input_quant.fake_quantize_input`, with the
checkpoint's static input scale where it has one: the values a serving kernel multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.format.input_quant import fake_quantize_input
from quantkit.format.layouts import PACK_QUANTIZED, layout_for
from quantkit.format.scheme import ActivationScheme, QuantizedWeight, QuantScheme
from quantkit.format.tensors import G_IDX, QUANTIZED_PARTS, ZERO, linear_parts, read_linear

KERNEL_BITS = (4, 8)  # the widths quant_matmul unpacks


def takes_kernel(scheme: QuantScheme) -> bool:
    """Whether a layer of ``scheme`` runs packed through ``quant_matmul``: integer weight-only 4/8-bit layers, the
    format the kernel unpacks; the others are dequantized once."""
    return layout_for(scheme) is PACK_QUANTIZED and scheme.bits in KERNEL_BITS


@dataclass(frozen=True, slots=True)
class InputQuant:
    """A linear's input quantization: its scheme and the checkpoint's static scale (``input_scale``, or NVFP4's
    ``input_global_scale``; None for dynamic schemes), float32 on the compute device."""

    acts: ActivationScheme
    static_scale: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_input(x, self.acts, self.static_scale)

    def same_as(self, other: InputQuant | None) -> bool:
        """Whether both quantize every input to the same values (so linears sharing an input may be fused)."""
        if other is None or self.acts != other.acts:
            return False
        if self.static_scale is None or other.static_scale is None:
            return self.static_scale is None and other.static_scale is None
        return torch.equal(self.static_scale, other.static_scale)


def input_quant_of(qw: QuantizedWeight, device: torch.device) -> InputQuant | None:
    """The input quantization a read checkpoint layer asks for (None: 16-bit inputs)."""
    acts = qw.scheme.activations
    if acts is None:
        return None
    static = qw.input_scale.float().to(device) if qw.input_scale is not None else None
    return InputQuant(acts, static)


class Linear(nn.Module):
    """``y = x W^T + b``: dense, packed for ``quant_matmul``, or dequantized once with a quantized input."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.scheme: QuantScheme | None = None  # set while the layer holds quantized tensors
        self.input_quant: InputQuant | None = None  # set by prepare for schemes that quantize the input
        self.use_kernel = False

    def quantize(self, scheme: QuantScheme, scale_dtype: torch.dtype = torch.bfloat16) -> None:
        """Swap the dense weight for empty checkpoint buffers of ``scheme`` (names, shapes and dtypes as stored)."""
        device = self.weight.device if self.weight is not None else None
        del self.weight  # an unpacked format stores its codes as a buffer named ``weight``
        self.scheme = scheme
        for part in linear_parts(scheme, self.out_features, self.in_features, scale_dtype):
            self.register_buffer(part.name, torch.empty(part.shape, dtype=part.dtype, device=device))

    def _parts(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in self.named_buffers(recurse=False) if name in QUANTIZED_PARTS}

    def quantized_weight(self) -> QuantizedWeight:
        """The layer's checkpoint tensors read back (:func:`read_linear`, on the CPU: the reader's checks are host
        code)."""
        assert self.scheme is not None
        return read_linear({name: t.cpu() for name, t in self._parts().items()}, "", self.scheme)

    def prepare(self, dtype: torch.dtype, use_kernel: bool) -> None:
        """Pick the compute path after loading: packed kernel, or a dense weight in ``dtype``, computed in fp32 as the
        reference QuantLinear computes it, then cast (with the input's quantization when the scheme has one)."""
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.to(dtype), requires_grad=False)
        if self.scheme is None:
            assert self.weight is not None
            self.weight = nn.Parameter(self.weight.to(dtype), requires_grad=False)
            return
        if use_kernel and takes_kernel(self.scheme):
            self.use_kernel = True
            return
        parts = self._parts()
        device = next(iter(parts.values())).device
        qw = self.quantized_weight()
        for name in parts:
            del self._buffers[name]
        self.scheme = None
        self.input_quant = input_quant_of(qw, device)
        self.weight = nn.Parameter(qw.dequantize(dtype).to(device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            from quantkit.runtime.kernels.quant_matmul import quant_matmul

            assert self.scheme is not None
            return quant_matmul(
                x,
                self.weight_packed,
                self.weight_scale,
                getattr(self, ZERO, None),
                getattr(self, G_IDX, None),
                self.scheme.bits,
                self.scheme.group_size,
                self.bias,
            )
        if self.input_quant is not None:
            x = self.input_quant(x)
        return F.linear(x, self.weight, self.bias)

    @property
    def is_dense(self) -> bool:
        """Whether the layer multiplies a dense weight parameter (after ``prepare``, or never quantized)."""
        return self.scheme is None and self.weight is not None

    def extra_repr(self) -> str:
        scheme = self.scheme.name if self.scheme is not None else "dense"
        acts = f", input {self.input_quant.acts.name}" if self.input_quant is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {scheme}{acts}"


@dataclass(slots=True)
class FusedLinear:
    """Dense linears sharing one input as one matmul: their weights (and biases) concatenated by output, and the
    input quantization they share."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    input_quant: InputQuant | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return F.linear(x, self.weight, self.bias)


def _same_input(linears: list[Linear]) -> bool:
    first = linears[0].input_quant
    if first is None:
        return all(lin.input_quant is None for lin in linears)
    return all(first.same_as(lin.input_quant) for lin in linears[1:])


def fuse_linears(linears: list[Linear]) -> FusedLinear | None:
    """One matmul for dense linears sharing an input, or None when one is not dense or their inputs are quantized
    differently (then each quantizes its own input, as the checkpoint says).

    Each linear's own weight (and bias) becomes a view into the fused tensor, so fusing costs no memory.
    """
    if not all(lin.is_dense for lin in linears) or not _same_input(linears):
        return None
    weight = torch.cat([lin.weight for lin in linears], dim=0)  # type: ignore[misc]
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias if lin.bias is not None else weight.new_zeros(lin.out_features) for lin in linears])
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight = nn.Parameter(weight[rows], requires_grad=False)
        if lin.bias is not None and bias is not None:
            lin.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += lin.out_features
    return FusedLinear(weight, bias, linears[0].input_quant)
