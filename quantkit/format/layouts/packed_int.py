"""compressed-tensors ``pack-quantized``: integer weights with 16-bit activations, codes packed into int32 words.

Tensors of one quantized Linear (N out, K in, G groups, b bits):

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
from quantkit.format.layouts.base import SCALE, ZERO, Layout, Part
from quantkit.format.pack import pack_int32, packed_words, unpack_int32
from quantkit.format.scheme import QuantizedWeight, QuantScheme

PACKED = "weight_packed"
SHAPE = "weight_shape"
G_IDX = "weight_g_idx"


def records_g_idx(scheme: QuantScheme) -> bool:
    """Act-order without static groups: column groups are not contiguous, so ``g_idx`` is stored."""
    return scheme.act_order and not scheme.static_groups


class PackedInt(Layout):
    format = "pack-quantized"

    def weight_parts(self, scheme: QuantScheme, n: int, k: int, scale_dtype: torch.dtype) -> list[Part]:
        bits, groups = scheme.bits, scheme.num_groups(k)
        parts = [Part(PACKED, (n, packed_words(k, bits)), torch.int32), Part(SCALE, (n, groups), scale_dtype)]
        if not scheme.symmetric:
            parts.append(Part(ZERO, (packed_words(n, bits), groups), torch.int32))
        parts.append(Part(SHAPE, (2,), torch.int64, counted=False))
        if records_g_idx(scheme):
            parts.append(Part(G_IDX, (k,), torch.int32))
        return parts

    def shape_of(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme) -> tuple[int, int]:
        if SHAPE not in tensors:
            raise QuantkitError(f"checkpoint tensor {SHAPE!r} is missing; the checkpoint is incomplete, re-export it")
        shape = tensors[SHAPE]
        if shape.numel() != 2:
            raise QuantkitError(f"{SHAPE!r} must hold 2 values (out, in), got {shape.tolist()}")
        n, k = (int(v) for v in shape.tolist())
        return n, k

    def write_weight(self, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        scheme = qw.scheme
        n, k = qw.shape
        if (qw.zero is None) != scheme.symmetric:
            raise QuantkitError(f"zero points must be given exactly when the scheme is asymmetric ({scheme.name})")
        if qw.g_idx is not None and not records_g_idx(scheme):
            raise QuantkitError("a g_idx can only be stored with act-order without static groups")
        if tuple(qw.scale.shape) != (n, scheme.num_groups(k)):
            raise QuantkitError(
                f"scale shape {tuple(qw.scale.shape)} does not match {scheme.name} on a [{n}, {k}] weight; "
                f"expected [{n}, {scheme.num_groups(k)}]"
            )
        out = {
            PACKED: pack_int32(qw.qweight, scheme.bits, dim=1),
            SCALE: qw.scale.to(scale_dtype).contiguous(),
            SHAPE: torch.tensor([n, k], dtype=torch.int64),
        }
        if qw.zero is not None:
            out[ZERO] = pack_int32(qw.zero, scheme.bits, dim=0)
        if records_g_idx(scheme):
            out[G_IDX] = qw.column_groups().to(torch.int32).contiguous()
        return out

    def read_weight(self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, n: int, k: int) -> QuantizedWeight:
        bits, groups = scheme.bits, scheme.num_groups(k)
        zero = None if scheme.symmetric else unpack_int32(tensors[ZERO], bits, n, dim=0)
        g_idx = None
        if records_g_idx(scheme):
            g_idx = tensors[G_IDX].to(torch.int32)
            if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                raise QuantkitError(f"{G_IDX!r} holds group indices outside [0, {groups})")
        qweight = unpack_int32(tensors[PACKED], bits, k, dim=1)
        return QuantizedWeight(qweight=qweight, scale=tensors[SCALE].float(), zero=zero, g_idx=g_idx, scheme=scheme)
