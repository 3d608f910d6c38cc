"""GGUF blocks from integer codes: ``Q4_0``, ``Q4_1`` and ``Q8_0`` bytes, and llama.cpp's q/k row permutation.

GGUF's 32-weight blocks hold one fp16 scale each, along the input dimension (ggml's ne0), the direction of
quantkit's groups:

- ``Q4_0`` (symmetric int4): ``d = scale``, nibble ``q + 8``; ``w = (nibble - 8) * d``, bit-exact.
- ``Q8_0`` (symmetric int8): ``d = scale``, ``q`` as is; ``w = q * d``, bit-exact.
- ``Q4_1`` (asymmetric int4): ``d = scale``, ``m = -scale * (zero + 8)`` rounded to fp16, nibble ``q + 8``;
  ``w = nibble * d + m`` differs from ``(q - zero) * scale`` where ``m``'s rounding shows (counted in the notes).

A group of 64 or 128 repeats its scale over its 32-blocks; per-channel repeats it along the row.
"""

from __future__ import annotations

import numpy as np
import torch

from quantkit.format.engines import GGUF_BLOCK as QK
from quantkit.format.scheme import QuantizedWeight


def head_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Row order llama.cpp's converter gives q/k: within each head, the two rotary halves interleaved."""
    return torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).transpose(1, 2).reshape(rows)


def permuted(qw: QuantizedWeight, n_head: int | None) -> QuantizedWeight:
    """Rows move with their codes, scales and zero points (groups run along K, so they move together)."""
    if n_head is None:
        return qw
    perm = head_permutation(qw.shape[0], n_head)
    zero = None if qw.zero is None else qw.zero[perm]
    return QuantizedWeight(qw.qweight[perm], qw.scale[perm], zero, qw.g_idx, qw.scheme)


def _block_columns(qw: QuantizedWeight, values: torch.Tensor) -> np.ndarray:
    """Per-group ``values`` [N, G] spread to one value per 32-block [N, K/32]."""
    groups = qw.column_groups()[::QK]
    return values[:, groups].numpy()


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """[N, B] -> [N, B, 2] little-endian fp16 bytes."""
    return values.astype("<f2").view(np.uint8).reshape(*values.shape, 2)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[N, B, 32] unsigned 4-bit codes -> [N, B, 16] bytes: weight j in the low nibble, j + 16 in the high."""
    return (codes[..., : QK // 2] | (codes[..., QK // 2 :] << 4)).astype(np.uint8)


def _blocked_codes(qw: QuantizedWeight, offset: int) -> np.ndarray:
    n, k = qw.shape
    return (qw.qweight.numpy().astype(np.int16) + offset).astype(np.uint8).reshape(n, k // QK, QK)


def q4_0_blocks(qw: QuantizedWeight) -> np.ndarray:
    """Symmetric int4 -> Q4_0 bytes [N, K/32 * 18]."""
    d = _fp16_bytes(_block_columns(qw, qw.scale))
    out = np.concatenate([d, _nibbles(_blocked_codes(qw, 8))], axis=-1)
    return out.reshape(qw.shape[0], -1)


def q8_0_blocks(qw: QuantizedWeight) -> np.ndarray:
    """Symmetric int8 -> Q8_0 bytes [N, K/32 * 34]."""
    n, k = qw.shape
    d = _fp16_bytes(_block_columns(qw, qw.scale))
    codes = qw.qweight.numpy().astype(np.int8).view(np.uint8).reshape(n, k // QK, QK)
    return np.concatenate([d, codes], axis=-1).reshape(n, -1)


def q4_1_minimum(qw: QuantizedWeight) -> torch.Tensor:
    """Q4_1's per-group offset ``m = -scale * (zero + 8)`` in fp16 (nibble = q + 8)."""
    assert qw.zero is not None
    return (-qw.scale * (qw.zero.float() + 8)).half()


def q4_1_blocks(qw: QuantizedWeight) -> tuple[np.ndarray, int]:
    """Asymmetric int4 -> Q4_1 bytes [N, K/32 * 20], and how many weights dequantize differently."""
    d = _block_columns(qw, qw.scale)
    m = _block_columns(qw, q4_1_minimum(qw).float())
    codes = _blocked_codes(qw, 8)
    out = np.concatenate([_fp16_bytes(d), _fp16_bytes(m), _nibbles(codes)], axis=-1).reshape(qw.shape[0], -1)
    # what a reader computes (fp32 multiply, then add), against the checkpoint's own dequantization
    got = d.astype(np.float16).astype(np.float32)[..., None] * codes.astype(np.float32) + m[..., None]
    want = qw.dequantize().numpy().reshape(codes.shape)
    return out, int((got.view(np.int32) != want.view(np.int32)).sum())
