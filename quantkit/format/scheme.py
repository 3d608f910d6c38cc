"""Weight quantization schemes and the container for a quantized weight.

A scheme is resolved once, before any solver loop, and is immutable afterwards.
Integer convention (the same as compressed-tensors): values are signed, in
``[-2**(bits-1), 2**(bits-1) - 1]``; zero points are signed in the same range; a weight dequantizes
as ``w = (q - zero) * scale`` (zero = 0 when symmetric).
Float weights (``type="float"``: FP8 E4M3 at 8 bits, FP4 E2M1 at 4) hold grid values ``q`` and dequantize as
``w = q * scale`` too; NVFP4 stores its group scales in FP8 under a float32 global scale, and ``scale`` is then the
effective one, ``stored / global_scale`` (see :mod:`quantkit.format.float_codes`).
Group of input column ``k``: ``g_idx[k]`` when a group index is recorded (act-order without static
groups), otherwise ``k // group_size`` (the last group is shorter when ``group_size`` does not divide
the in-features); per-channel (``group_size == -1``) and per-tensor (``group_size == 0``) are a single group,
and ``block`` tiles the weight in square blocks (one scale per tile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.format.float_codes import FP4_MAX, FP8_MAX, MX_GROUP, NV_GROUP

SUPPORTED_BITS = (2, 3, 4, 8)
FLOAT_BITS = (4, 8)  # FP4 E2M1, FP8 E4M3
TYPES = ("int", "float")
SCALE_FORMATS = ("native", "fp8", "e8m0")  # the model's dtype; FP8 under a float32 global scale (NVFP4); MX
ACTIVATION_STRATEGIES = ("token", "tensor", "group", "tensor_group")


@dataclass(frozen=True)
class ActivationScheme:
    """How a linear's input is quantized at inference (compressed-tensors' ``input_activations``)."""

    type: str = "int"
    bits: int = 8
    strategy: str = "token"  # token: a scale per row; tensor: one; group / tensor_group: per group of columns
    dynamic: bool | str = True  # True: computed per call; False: a static scale; "local": dynamic per group
    group_size: int | None = None  # under a static global scale (NVFP4)
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.type not in TYPES or self.strategy not in ACTIVATION_STRATEGIES:
            raise QuantkitError(f"activation scheme {self.type} / {self.strategy} is not one quantkit writes")
        if (self.strategy in ("group", "tensor_group")) != bool(self.group_size):
            raise QuantkitError(f"activation strategy {self.strategy} takes a group size exactly when grouped")

    @property
    def name(self) -> str:
        kind = f"a{self.bits}" if self.type == "int" else f"afp{self.bits}"
        group = f"g{self.group_size}" if self.group_size else self.strategy
        return f"{kind}-{group}-{'dyn' if self.dynamic else 'static'}"

    @property
    def scale_format(self) -> str:
        """How its group scales are kept (as :attr:`QuantScheme.scale_format`): E8M0 for the MX groups of 32, FP8
        for NVFP4's groups of 16, the model's dtype otherwise."""
        if self.type == "float" and self.group_size == MX_GROUP:
            return "e8m0"
        if self.type == "float" and self.bits == 4:
            return "fp8"
        return "native"

    @property
    def static_scale(self) -> bool:
        """Whether calibration must fix a scale: a static one, or NVFP4's static global scale."""
        return self.dynamic is not True


KV_CACHE_STRATEGIES = ("tensor", "attn_head")  # one key and one value scale per layer, or per KV head


@dataclass(frozen=True)
class KVCacheScheme:
    """How the attention's key/value cache is stored (compressed-tensors' ``kv_cache_scheme``): FP8 E4M3 under
    static scales, ``k_scale`` / ``v_scale`` beside each attention, calibrated on the calibration windows."""

    type: str = "float"
    bits: int = 8
    strategy: str = "tensor"

    def __post_init__(self) -> None:
        if (self.type, self.bits) != ("float", 8) or self.strategy not in KV_CACHE_STRATEGIES:
            raise QuantkitError(
                f"kv cache scheme {self.type}{self.bits} / {self.strategy} is not supported; quantkit writes FP8 "
                f"caches with strategy {' or '.join(KV_CACHE_STRATEGIES)}"
            )

    @property
    def name(self) -> str:
        return "fp8" if self.strategy == "tensor" else "fp8-head"


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: int = 128  # -1: one group per output channel; 0: one scale for the whole tensor
    symmetric: bool = True
    act_order: bool = False  # GPTQ: process columns by descending Hessian diagonal
    static_groups: bool = False  # with act_order: groups fixed in the original column order
    mse_clip: bool = False  # search a shrunken range that lowers the (weighted) error
    type: str = "int"  # "float": FP8 E4M3 or FP4 E2M1 values
    scale_format: str = "native"  # how scales are stored (SCALE_FORMATS)
    block: int = 0  # square tiles of this size, one scale each (FP8_BLOCK); 0: no tiles
    activations: ActivationScheme | None = None  # None: 16-bit activations (weight-only)
    # int8 codes stored a byte each as ``weight`` itself (compressed-tensors' naive-quantized) instead of packed into
    # int32 words: the only quantized embedding transformers 5.22 loads (quantkit.format.outer_engines)
    unpacked: bool = False

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise QuantkitError(f"weight type {self.type!r} is not supported; use one of {list(TYPES)}")
        allowed = FLOAT_BITS if self.type == "float" else SUPPORTED_BITS
        if self.bits not in allowed:
            raise QuantkitError(
                f"bits={self.bits} is not supported for {self.type} weights; use one of {list(allowed)}"
            )
        if self.group_size < -1 or (self.group_size == 0 and not self.is_float):
            raise QuantkitError(
                f"group size {self.group_size} is invalid; "
                "use a positive size such as 32, 64, 128, or -1 for per-channel (0, one scale per tensor: float only)"
            )
        if self.scale_format not in SCALE_FORMATS:
            raise QuantkitError(f"scale format {self.scale_format!r} is not one of {list(SCALE_FORMATS)}")
        if self.is_float and not self.symmetric:
            raise QuantkitError("float weights are symmetric (compressed-tensors has no FP4/FP8 zero points)")
        if self.scale_format != "native" and (not self.is_float or self.group_size <= 0):
            raise QuantkitError(f"{self.scale_format} scales are for grouped float weights (NVFP4, MX formats)")
        if self.is_float and self.bits == 4 and self.scale_format == "native":
            raise QuantkitError(
                "FP4 weights take FP8 scales (NVFP4, groups of 16) or E8M0 scales (MXFP4, groups of 32)"
            )
        if self.scale_format == "fp8" and (self.bits, self.group_size) != (4, NV_GROUP):
            raise QuantkitError(f"FP8 scales are NVFP4's: FP4 weights in groups of {NV_GROUP}")
        if self.scale_format == "e8m0" and self.group_size != MX_GROUP:
            raise QuantkitError(f"MX formats put one E8M0 scale on each {MX_GROUP} weights, not {self.group_size}")
        if self.unpacked and (
            self.is_float or self.bits != 8 or self.activations is not None or not self.symmetric or self.act_order
        ):
            raise QuantkitError(
                "unpacked codes are for symmetric 8-bit INT weights in their own column order with 16-bit "
                f"activations (a byte per code); {self.name.removesuffix('-unpacked')} is written packed"
            )
        if self.block and (self.group_size != 0 or self.block < 0):
            raise QuantkitError(f"block scales ({self.block} x {self.block}) take group_size 0, not {self.group_size}")

    @property
    def element_max(self) -> float:
        """The largest magnitude a code holds: qmax for integers, 448 for FP8 E4M3, 6 for FP4 E2M1."""
        if self.is_float:
            return FP8_MAX if self.bits == 8 else FP4_MAX
        return float(self.qmax)

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype a solver keeps codes in: int8, or FP8 E4M3 for float codes (every FP4 value is one)."""
        return torch.float8_e4m3fn if self.is_float else torch.int8

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def per_channel(self) -> bool:
        return self.group_size == -1

    @property
    def per_tensor(self) -> bool:
        return self.group_size == 0 and not self.block

    @property
    def is_float(self) -> bool:
        return self.type == "float"

    @property
    def strategy(self) -> str:
        """compressed-tensors' name for how scales are laid out."""
        if self.block:
            return "block"
        if self.per_tensor:
            return "tensor"
        if self.per_channel:
            return "channel"
        return "tensor_group" if self.scale_format == "fp8" else "group"

    def group_len(self, in_features: int) -> int:
        """Columns per group (the last group may be shorter)."""
        if self.block:
            return self.block
        return in_features if self.per_channel or self.per_tensor else self.group_size

    def num_groups(self, in_features: int) -> int:
        return math.ceil(in_features / self.group_len(in_features))

    @property
    def name(self) -> str:
        """Short, stable name, e.g. ``w4-g128-sym``, ``w8-ch-asym-actorder``, ``nvfp4-g16+afp4-g16-dyn``."""
        if self.is_float:
            kind = {"fp8": "nv", "e8m0": "mx"}.get(self.scale_format, "") + f"fp{self.bits}"
            group = f"b{self.block}" if self.block else "tensor" if self.per_tensor else self._group_label()
            parts = [kind, group]
        else:
            parts = [f"w{self.bits}", self._group_label(), "sym" if self.symmetric else "asym"]
        if self.act_order:
            parts.append("actorder-static" if self.static_groups else "actorder")
        if self.mse_clip:
            parts.append("mse")
        if self.unpacked:
            parts.append("unpacked")
        name = "-".join(parts)
        return name if self.activations is None else f"{name}+{self.activations.name}"

    def _group_label(self) -> str:
        return "ch" if self.per_channel else "tensor" if self.per_tensor else f"g{self.group_size}"


@dataclass(slots=True)
class QuantizedWeight:
    """Quantized weight of one Linear, with everything needed to dequantize it.

    qweight: int8 [N, K] signed integers, or float codes in FP8 E4M3 (:attr:`QuantScheme.code_dtype`); scale:
    float32 [N, G] effective scales (already rounded to the storage format: the model's dtype, an FP8 value over the
    global scale, or a power of two; [1, 1] per tensor; block scales repeated over the rows of their tile); zero:
    int8 [N, G] signed zero points or None when symmetric; g_idx: int32 [K] or None; global_scale: float32 [1],
    NVFP4's per-tensor scale (the stored FP8 scales are ``scale * global_scale``) or None; input_scale: float32
    [1], the static scale of the linear's input (the global scale for an NVFP4 input) or None.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None
    scheme: QuantScheme
    global_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), int(self.qweight.shape[1]))

    def rows(self, rows: slice) -> QuantizedWeight:
        """The weight of output rows ``rows`` (one linear of a row-stacked solve); scales shared by every row (per
        tensor, NVFP4's global scale) stay shared."""
        scale = self.scale if self.scale.shape[0] == 1 else self.scale[rows].contiguous()
        zero = None if self.zero is None else self.zero[rows].contiguous()
        return QuantizedWeight(
            self.qweight[rows].contiguous(), scale, zero, self.g_idx, self.scheme, self.global_scale, self.input_scale
        )

    def column_groups(self) -> torch.Tensor:
        """int64 [K]: the group of each input column."""
        k = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k) // self.scheme.group_len(k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        groups = self.column_groups()
        scale = self.scale.float()[:, groups]
        q = self.qweight.float()
        if self.zero is not None:
            q = q - self.zero.float()[:, groups]
        return (q * scale).to(dtype)
