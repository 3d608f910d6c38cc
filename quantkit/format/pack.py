"""The one place that knows the bit layout of packed integer weights.

Layout (compressed-tensors ``pack-quantized``): signed integers ``q`` in ``[-2**(b-1), 2**(b-1) - 1]`` are
stored as unsigned ``q + 2**(b-1)`` and written as a dense little-endian bit stream along the packed
dimension: element ``e`` occupies bits ``[e*b, (e+1)*b)`` of the stream, word ``w`` holds stream bits
``[32*w, 32*w + 32)`` (lowest bits first), so an element may straddle two int32 words when ``b`` does not
divide 32. A row of ``n`` elements takes ``ceil(n*b/32)`` int32 words. Weights pack along dim 1 (K);
zero points pack along dim 0 (N).
"""

from __future__ import annotations

import math

import torch

_WORD = 32
_MASK32 = (1 << 32) - 1
_CHUNK_ELEMENTS = 1 << 20  # elements per row chunk: int64 temporaries of about 8 MB


def packed_words(n: int, bits: int) -> int:
    """int32 words needed for ``n`` elements of ``bits`` bits."""
    return math.ceil(n * bits / _WORD)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"packing supports 1..8 bits, got {bits}")


def _rows_per_chunk(cols: int) -> int:
    """Rows per chunk whose int64 temporaries stay near ``_CHUNK_ELEMENTS`` elements."""
    return max(1, _CHUNK_ELEMENTS // max(cols, 1))


def pack_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack a 2-D tensor of signed ``bits``-bit integers into int32 words along ``dim``.

    Works through row chunks: the bit arithmetic is done in int64, and whole-matrix temporaries would
    cost 8 bytes per weight several times over (1 GB for one 11008 x 4096 linear).
    """
    _check_bits(bits)
    if values.ndim != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(values.shape)}")
    if dim == 0:
        return pack_int32(values.t(), bits, dim=1).t().contiguous()
    rows, cols = values.shape
    out = torch.empty(rows, packed_words(cols, bits), dtype=torch.int32)
    step = _rows_per_chunk(cols)
    for start in range(0, rows, step):
        out[start : start + step] = _pack_rows(values[start : start + step], bits)
    return out


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    rows, cols = values.shape
    unsigned = values.to(torch.int64) + (1 << (bits - 1))
    if bool((unsigned < 0).any()) or bool((unsigned >= (1 << bits)).any()):
        raise ValueError(f"values out of range for signed {bits}-bit integers")
    padded = math.ceil(cols / _WORD) * _WORD  # 32 elements fill exactly `bits` words
    unsigned = torch.nn.functional.pad(unsigned, (0, padded - cols)).reshape(rows, padded // _WORD, _WORD)
    words = torch.zeros(rows, padded // _WORD, bits + 1, dtype=torch.int64)
    for i in range(_WORD):
        start = i * bits
        word, offset = divmod(start, _WORD)
        shifted = unsigned[:, :, i] << offset  # at most 8 + 31 bits: fits int64
        words[:, :, word] |= shifted & _MASK32
        words[:, :, word + 1] |= shifted >> _WORD
    flat = words[:, :, :bits].reshape(rows, -1)[:, : packed_words(cols, bits)]
    return _to_int32(flat)


def unpack_int32(packed: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``n`` signed integers (int8) per row along ``dim``."""
    _check_bits(bits)
    if packed.ndim != 2 or packed.dtype != torch.int32:
        raise ValueError(f"expected a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if dim == 0:
        return unpack_int32(packed.t(), bits, n, dim=1).t().contiguous()
    rows, nwords = packed.shape
    if nwords != packed_words(n, bits):
        raise ValueError(f"{nwords} words cannot hold exactly {n} elements of {bits} bits")
    out = torch.empty(rows, n, dtype=torch.int8)
    step = _rows_per_chunk(n)
    for start in range(0, rows, step):  # row chunks, as in pack_int32
        out[start : start + step] = _unpack_rows(packed[start : start + step], bits, n)
    return out


def _unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    rows, nwords = packed.shape
    chunks = math.ceil(n / _WORD)
    words = packed.to(torch.int64) & _MASK32
    words = torch.nn.functional.pad(words, (0, chunks * bits + 1 - nwords)).unfold(1, bits + 1, bits)
    words = words[:, :chunks]  # [rows, chunks, bits + 1]: each chunk's words plus one spare
    out = torch.empty(rows, chunks, _WORD, dtype=torch.int64)
    mask = (1 << bits) - 1
    for i in range(_WORD):
        word, offset = divmod(i * bits, _WORD)
        joined = words[:, :, word] | (words[:, :, word + 1] << _WORD)
        out[:, :, i] = (joined >> offset) & mask
    values = out.reshape(rows, -1)[:, :n] - (1 << (bits - 1))
    return values.to(torch.int8)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    signed = torch.where(words >= (1 << 31), words - (1 << 32), words)
    return signed.to(torch.int32)
