"""What every checkpoint layout of one quantized Linear shares: the parts it is stored as (name, shape, dtype),
how scales are laid out per strategy, and the tensors of a quantized input (static activation scales).

A layout (one module per compressed-tensors format) writes a :class:`QuantizedWeight` as named tensors and reads
them back; :meth:`Layout.parts` is the one description of those tensors that the writer, the reader's checks,
:class:`quantkit.format.quant_linear.QuantLinear`'s buffers, the runtime's layers, ``inspect`` and the size
estimates all use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.format.scheme import ActivationScheme, QuantizedWeight, QuantScheme

SCALE = "weight_scale"
ZERO = "weight_zero_point"
INPUT_SCALE = "input_scale"  # a static input scale (FP8 / INT8 per tensor)
INPUT_GLOBAL = "input_global_scale"  # NVFP4's static global scale of the input, under its dynamic group scales


@dataclass(frozen=True, slots=True)
class Part:
    """One stored tensor of a quantized Linear."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    counted: bool = True  # False: metadata not counted in the bits per weight (weight_shape)

    @property
    def bits(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size() * 8


def stored_scale_shape(scheme: QuantScheme, n: int, k: int) -> tuple[int, ...]:
    """The shape of ``weight_scale`` as compressed-tensors stores it for the scheme's strategy."""
    if scheme.per_tensor:
        return (1,)
    if scheme.block:
        return (-(-n // scheme.block), scheme.num_groups(k))
    return (n, scheme.num_groups(k))


def stored_rows(scale: torch.Tensor, scheme: QuantScheme, n: int, k: int) -> torch.Tensor:
    """A :class:`QuantizedWeight`'s scale ([N, G], [1, 1] per tensor, block scales repeated over their rows) in the
    stored shape; block scales must be equal over each tile's rows."""
    if scheme.per_tensor:
        return scale.reshape(1).clone()  # its own storage: linears solved together share one scale tensor
    if scheme.block:
        tiles = scale[:: scheme.block]
        if not torch.equal(tiles.repeat_interleave(scheme.block, dim=0)[:n], scale):
            raise QuantkitError(f"block scales of a {scheme.name} weight differ within a {scheme.block}-row tile")
        return tiles
    return scale


def expanded_rows(stored: torch.Tensor, scheme: QuantScheme, n: int) -> torch.Tensor:
    """Inverse of :func:`stored_rows`: float32 scales as a :class:`QuantizedWeight` holds them."""
    stored = stored.float()
    if scheme.per_tensor:
        return stored.reshape(1, 1)
    if scheme.block:
        return stored.repeat_interleave(scheme.block, dim=0)[:n].contiguous()
    return stored


def activation_parts(activations: ActivationScheme | None, scale_dtype: torch.dtype) -> list[Part]:
    """The tensors a quantized input adds: a static scale (FP8 / INT8 per tensor), or NVFP4's static global
    scale under its dynamic group scales; none for dynamic schemes."""
    if activations is None or activations.dynamic is True:
        return []
    if activations.dynamic == "local":
        return [Part(INPUT_GLOBAL, (1,), torch.float32)]
    return [Part(INPUT_SCALE, (1,), scale_dtype)]


def check_parts(parts: list[Part], tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Every part present with its shape and dtype, or one error naming the first that is not."""
    for part in parts:
        key = f"{where}.{part.name}" if where else part.name
        if part.name not in tensors:
            raise QuantkitError(f"checkpoint tensor {key!r} is missing; the checkpoint is incomplete, re-export it")
        tensor = tensors[part.name]
        if tuple(tensor.shape) != part.shape or tensor.dtype != part.dtype:
            raise QuantkitError(
                f"checkpoint tensor {key!r} is {tensor.dtype} {list(tensor.shape)}, expected {part.dtype} "
                f"{list(part.shape)}; the checkpoint does not match its quantization_config"
            )


class Layout(ABC):
    """One compressed-tensors format: the tensors of one quantized Linear, written and read back."""

    format: str  # compressed-tensors' name, written as the config group's "format"

    @abstractmethod
    def weight_parts(self, scheme: QuantScheme, n: int, k: int, scale_dtype: torch.dtype) -> list[Part]:
        raise NotImplementedError

    def parts(self, scheme: QuantScheme, n: int, k: int, scale_dtype: torch.dtype) -> list[Part]:
        """Every stored tensor of an [n, k] Linear (weight parts, then a quantized input's)."""
        return [*self.weight_parts(scheme, n, k, scale_dtype), *activation_parts(scheme.activations, scale_dtype)]

    @abstractmethod
    def shape_of(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme) -> tuple[int, int]:
        """(out, in) features of the stored Linear, from its tensors."""
        raise NotImplementedError

    @abstractmethod
    def write_weight(self, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @abstractmethod
    def read_weight(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, n: int, k: int) -> QuantizedWeight:
        raise NotImplementedError

    def write(self, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors of one quantized Linear, unprefixed."""
        out = self.write_weight(qw, scale_dtype)
        acts = qw.scheme.activations
        for part in activation_parts(acts, scale_dtype):
            if qw.input_scale is None:
                raise QuantkitError(
                    f"the {acts.name if acts else ''} input scheme needs a static input scale, calibrated on "
                    "calibration windows; give --calib (or a recipe's calibration section), or pick a dynamic scheme"
                )
            out[part.name] = qw.input_scale.reshape(1).to(part.dtype).clone()
        n, k = qw.shape
        check_parts(self.parts(qw.scheme, n, k, scale_dtype), out, "")
        return out

    def read(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, where: str = "") -> QuantizedWeight:
        """Inverse of :meth:`write` (scales as float32); ``where`` names the Linear in errors."""
        n, k = self.shape_of(tensors, scheme)
        scale_dtype = tensors[SCALE].dtype if SCALE in tensors else torch.bfloat16
        check_parts(self.parts(scheme, n, k, scale_dtype), tensors, where)
        qw = self.read_weight(tensors, scheme, n, k)
        for part in activation_parts(scheme.activations, scale_dtype):
            qw.input_scale = tensors[part.name].float().reshape(1)
        return qw
