"""The checkpoint tensors of one quantized Linear, written and read back (compressed-tensors
``pack-quantized``).

Tensors of one quantized Linear (N out, K in, G groups, b bits), named ``<prefix>.<name>``:

- ``weight_packed``      int32 [N, ceil(K*b/32)]   q packed along K (see :mod:`quantkit.format.pack`)
- ``weight_scale``       storage dtype [N, G]      ([N, 1] per-channel)
- ``weight_zero_point``  int32 [ceil(N*b/32), G]   asymmetric only; zero points packed along N (dim 0)
- ``weight_shape``       int64 [2]                 (N, K)
- ``weight_g_idx``       int32 [K]                 act-order without static groups only
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.errors import QuantkitError
from quantkit.format.pack import pack_int32, packed_words, unpack_int32
from quantkit.format.scheme import QuantizedWeight, QuantScheme

PACKED = "weight_packed"
SCALE = "weight_scale"
ZERO = "weight_zero_point"
SHAPE = "weight_shape"
G_IDX = "weight_g_idx"
QUANTIZED_PARTS = (PACKED, SCALE, ZERO, SHAPE, G_IDX)  # every tensor of one quantized Linear's weight


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def records_g_idx(scheme: QuantScheme) -> bool:
    """Act-order without static groups: column groups are not contiguous, so ``g_idx`` is stored."""
    return scheme.act_order and not scheme.static_groups


# --------------------------------------------------------------------------------------------------
# Per-Linear tensors
# --------------------------------------------------------------------------------------------------


def linear_tensors(prefix: str, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one quantized Linear (names prefixed with ``prefix.``)."""
    scheme = qw.scheme
    n, k = qw.shape
    if tuple(qw.scale.shape) != (n, scheme.num_groups(k)):
        raise QuantkitError(
            f"{prefix}: scale shape {tuple(qw.scale.shape)} does not match {scheme.name} on a [{n}, {k}] weight; "
            f"expected [{n}, {scheme.num_groups(k)}]"
        )
    if (qw.zero is None) != scheme.symmetric:
        raise QuantkitError(
            f"{prefix}: zero points must be given exactly when the scheme is asymmetric ({scheme.name})"
        )
    if qw.g_idx is not None and not records_g_idx(scheme):
        raise QuantkitError(f"{prefix}: a g_idx can only be stored with act-order without static groups")

    out = {
        _key(prefix, PACKED): pack_int32(qw.qweight, scheme.bits, dim=1),
        _key(prefix, SCALE): qw.scale.to(scale_dtype).contiguous(),
        _key(prefix, SHAPE): torch.tensor([n, k], dtype=torch.int64),
    }
    if qw.zero is not None:
        out[_key(prefix, ZERO)] = pack_int32(qw.zero, scheme.bits, dim=0)
    if records_g_idx(scheme):
        out[_key(prefix, G_IDX)] = qw.column_groups().to(torch.int32).contiguous()
    return out


DENSE_BITS = 16  # an unquantized (fp16/bf16) weight
_WORD_BITS = 32
_INDEX_BITS = 32  # g_idx and zero-point words are int32


def storage_bits(scheme: QuantScheme | None, n_out: int, k_in: int, scale_bits: int = 16) -> int:
    """Exact bits of one Linear's stored weight tensors ([n_out, k_in] weight), as inspect_checkpoint counts.

    packed int32 [N, ceil(K*b/32)] + scales [N, G] x ``scale_bits`` + (asym) zero points int32
    [ceil(N*b/32), G] + (act-order without static groups) g_idx int32 [K]. ``None`` (fp16): 16 bits a weight.
    """
    if n_out <= 0 or k_in <= 0:
        raise QuantkitError(f"a Linear weight must have positive dimensions, got [{n_out}, {k_in}]")
    if scheme is None:
        return DENSE_BITS * n_out * k_in
    groups = scheme.num_groups(k_in)
    bits = n_out * packed_words(k_in, scheme.bits) * _WORD_BITS + n_out * groups * scale_bits
    if not scheme.symmetric:
        bits += packed_words(n_out, scheme.bits) * _INDEX_BITS * groups
    if records_g_idx(scheme):
        bits += k_in * _INDEX_BITS
    return bits


def _get(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise QuantkitError(f"checkpoint tensor {key!r} is missing; the checkpoint is incomplete, re-export it")
    return tensors[key]


def _expect_shape(key: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
        want = f"{dtype} {list(shape)}" if dtype is not None else str(list(shape))
        raise QuantkitError(
            f"checkpoint tensor {key!r} is {tensor.dtype} {list(tensor.shape)}, expected {want}; "
            "the checkpoint does not match its quantization_config"
        )


def read_linear(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> QuantizedWeight:
    """Inverse of :func:`linear_tensors`: the integer weight of one Linear (scales as float32)."""
    shape = _get(tensors, _key(prefix, SHAPE))
    if shape.numel() != 2:
        raise QuantkitError(f"{_key(prefix, SHAPE)!r} must hold 2 values (out, in), got {shape.tolist()}")
    n, k = (int(v) for v in shape.tolist())
    bits, groups = scheme.bits, scheme.num_groups(k)

    packed = _get(tensors, _key(prefix, PACKED))
    _expect_shape(_key(prefix, PACKED), packed, (n, packed_words(k, bits)), torch.int32)
    scale = _get(tensors, _key(prefix, SCALE))
    _expect_shape(_key(prefix, SCALE), scale, (n, groups))
    zero = None
    if not scheme.symmetric:
        zp = _get(tensors, _key(prefix, ZERO))
        _expect_shape(_key(prefix, ZERO), zp, (packed_words(n, bits), groups), torch.int32)
        zero = unpack_int32(zp, bits, n, dim=0)
    g_idx = None
    if records_g_idx(scheme):
        g_idx = _get(tensors, _key(prefix, G_IDX))
        _expect_shape(_key(prefix, G_IDX), g_idx, (k,))
        g_idx = g_idx.to(torch.int32)
        if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise QuantkitError(f"{_key(prefix, G_IDX)!r} holds group indices outside [0, {groups})")
    qweight = unpack_int32(packed, bits, k, dim=1)
    return QuantizedWeight(qweight=qweight, scale=scale.float(), zero=zero, g_idx=g_idx, scheme=scheme)
