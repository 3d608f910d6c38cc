"""Stored parameters and codes -> the bytes llama.cpp keeps for a tensor, one function per block layout.

Layouts (ggml-common.h's block structs; element e of a block is the e-th weight along the row):

- Q4_0 ``d | qs[16]``, Q4_1 ``d m | qs[16]``, IQ4_NL ``d | qs[16]``: qs[j] = code[j] | code[j + 16] << 4.
- Q5_0 ``d | qh[4] | qs[16]``, Q5_1 ``d m | qh[4] | qs[16]``: low nibbles as Q4_0; bit e of the little-endian
  uint32 qh is bit 4 of code[e].  Q8_0 ``d | qs[32]`` (int8 levels).
- Q2_K ``scales[16] | qs[64] | d dmin``: scales[j] = sc_j | m_j << 4; within each half of 128 weights, byte l holds
  code[l + 32 i] in bits 2i..2i+1 (i = 0..3).
- Q3_K ``hmask[32] | qs[64] | scales[12] | d``: code = level + 4; its two low bits as Q2_K's qs; bit 2 in hmask
  (element e: byte e % 32, bit e // 32); the 16 6-bit codes sc + 32: low nibbles in bytes 0..7 (sub-blocks 0..7 low,
  8..15 high nibble), their top two bits in byte 8 + j % 4 at bits 2 (j // 4).
- Q4_K ``d dmin | scales[12] | qs[128]``, Q5_K ``d dmin | scales[12] | qh[32] | qs[128]``: 6-bit sc/m codes, for
  j < 4 in the low 6 bits of bytes j / j + 4; for j >= 4 the low nibbles in byte j + 4 (sc low, m high) and the top two
  bits in bits 6..7 of bytes j - 4 (sc) / j (m). Within each 64 weights, byte l holds code[l] low and code[l + 32]
  high; Q5_K's fifth bit: element e at byte e % 32, bit e // 32.
- Q6_K ``ql[128] | qh[64] | scales[16] (int8) | d``: code = level + 32; per half of 128 weights with quarters
  Q0..Q3 of 32, ql[l] = Q0 | Q2 << 4, ql[l + 32] = Q1 | Q3 << 4 (low nibbles), qh[l] = sum_i (Q_i >> 4) << 2i.
"""

from __future__ import annotations

import numpy as np
import torch

from quantkit.format.ggml.grids import GGML_GRIDS, GGMLParams
from quantkit.format.ggml.types import GGMLType, row_bytes


def _f16(x: torch.Tensor) -> np.ndarray:
    """[N, B] fp16 -> [N, B, 2] little-endian bytes."""
    a = x.numpy().astype("<f2")
    return a.view(np.uint8).reshape(*a.shape, 2)


def _u8(x: torch.Tensor) -> np.ndarray:
    return x.numpy().astype(np.int64)


def _nibbles(c: np.ndarray) -> np.ndarray:
    """[..., 32] 4-bit codes -> [..., 16]: element j low, j + 16 high."""
    return (c[..., :16] & 0xF) | ((c[..., 16:] & 0xF) << 4)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """[..., 256] single bits -> [..., 32]: element e at byte e % 32, bit e // 32."""
    b = bits.reshape(*bits.shape[:-1], 8, 32)
    return (b << np.arange(8).reshape(8, 1)).sum(axis=-2)


def _crumbs(c: np.ndarray) -> np.ndarray:
    """[..., 256] 2-bit codes -> [..., 64]: per half of 128, byte l holds code[l + 32 i] at bits 2i."""
    b = c.reshape(*c.shape[:-1], 2, 4, 32) & 3
    return (b << (2 * np.arange(4)).reshape(4, 1)).sum(axis=-2).reshape(*c.shape[:-1], 64)


def _k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[..., 8] 6-bit scale and min codes -> [..., 12] (Q4_K/Q5_K packing)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.int64)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)
    return out


def _q3_scales(sc: np.ndarray) -> np.ndarray:
    """[..., 16] signed 6-bit scale codes -> [..., 12] (Q3_K packing of sc + 32)."""
    u = sc + 32
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.int64)
    out[..., 0:8] = (u[..., :8] & 0xF) | ((u[..., 8:] & 0xF) << 4)
    high = (u >> 4).reshape(*u.shape[:-1], 4, 4)  # [j // 4, j % 4]
    out[..., 8:12] = (high << (2 * np.arange(4)).reshape(4, 1)).sum(axis=-2)
    return out


def _blocks(params: GGMLParams, codes: np.ndarray, name: str) -> list[np.ndarray]:
    """The block's fields, each [N, B, bytes], in storage order."""
    n, k = codes.shape
    grid = GGML_GRIDS[name]
    c = codes.astype(np.int64).reshape(n, k // grid.type.block, grid.type.block)
    d = _f16(params.d)
    if name in ("Q4_0", "IQ4_NL"):
        return [d, _nibbles(c)]
    if name == "Q8_0":
        return [d, c]
    if name in ("Q4_1", "Q5_1"):
        assert params.dmin is not None
        head = [d, _f16(params.dmin)]
    else:
        head = [d]
    if name in ("Q4_1",):
        return [*head, _nibbles(c)]
    if name in ("Q5_0", "Q5_1"):
        qh = np.packbits((c >> 4).astype(np.uint8) & 1, axis=-1, bitorder="little")
        return [*head, qh, _nibbles(c)]
    sc = _u8(params.sc).reshape(n, -1, grid.per_block)  # type: ignore[union-attr]
    if name == "Q6_K":
        q = c.reshape(n, -1, 2, 4, 32)
        lo = q & 0xF  # [N, B, half, quarter, 32]
        ql = np.stack([lo[:, :, :, 0] | (lo[:, :, :, 2] << 4), lo[:, :, :, 1] | (lo[:, :, :, 3] << 4)], axis=3)
        qh = ((q >> 4) << (2 * np.arange(4)).reshape(4, 1)).sum(axis=-2)
        return [ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc & 0xFF, d]
    if name == "Q3_K":
        return [_bit_planes(c >> 2 & 1), _crumbs(c), _q3_scales(sc), d]
    assert params.dmin is not None and params.mn is not None
    mn = _u8(params.mn).reshape(n, -1, grid.per_block)
    dmin = _f16(params.dmin)
    if name == "Q2_K":
        return [sc | (mn << 4), _crumbs(c), d, dmin]
    q = c.reshape(n, -1, 4, 2, 32)
    qs = ((q[:, :, :, 0] & 0xF) | ((q[:, :, :, 1] & 0xF) << 4)).reshape(n, -1, 128)
    if name == "Q4_K":
        return [d, dmin, _k4_scales(sc, mn), qs]
    assert name == "Q5_K"
    return [d, dmin, _k4_scales(sc, mn), _bit_planes(c >> 4 & 1), qs]


def encode(t: GGMLType, params: GGMLParams, codes: np.ndarray) -> np.ndarray:
    """uint8 [N, row_bytes]: the tensor's bytes as llama.cpp stores them (``codes``: uint8 [N, K] stored codes)."""
    n, k = codes.shape
    fields = [f.astype(np.uint8) for f in _blocks(params, codes, t.name)]
    out = np.concatenate(fields, axis=-1).reshape(n, -1)
    assert out.shape[1] == row_bytes(t, k), (t.name, out.shape)
    return out
