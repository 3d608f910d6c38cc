"""Bit packing: exact round trips for every width and odd shapes, and row chunking that changes nothing."""

import pytest
import torch

from quantkit.format import pack
from quantkit.format.pack import pack_int32, packed_words, unpack_int32


def _random_ints(rows: int, cols: int, bits: int, seed: int = 0) -> torch.Tensor:
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)
    return torch.randint(low, high, (rows, cols), generator=torch.Generator().manual_seed(seed)).to(torch.int8)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 31), (7, 33), (5, 576), (2, 100)])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip_is_bit_exact(bits: int, rows: int, cols: int, dim: int) -> None:
    values = _random_ints(rows, cols, bits)
    packed = pack_int32(values, bits, dim=dim)
    n = values.shape[dim]
    assert packed.dtype == torch.int32 and packed.shape[dim] == packed_words(n, bits)
    assert torch.equal(unpack_int32(packed, bits, n, dim=dim), values)


def test_known_layout_lowest_bits_first() -> None:
    # 4-bit values -8..7 stored as 0..15: eight per word, element 0 in bits 0-3.
    values = torch.arange(-8, 8, dtype=torch.int8).reshape(1, 16)
    words = pack_int32(values, 4)
    assert words.tolist() == [[0x76543210, -0x01234568]]  # 0xFEDCBA98 as a signed int32


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_row_chunks_give_the_same_words(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    values = _random_ints(37, 70, bits, seed=1)
    whole = pack_int32(values, bits)
    monkeypatch.setattr(pack, "_CHUNK_ELEMENTS", 150)  # two rows of 70 per chunk, the last chunk short
    chunked = pack_int32(values, bits)
    assert torch.equal(chunked, whole)
    assert torch.equal(unpack_int32(chunked, bits, 70), values)
    assert torch.equal(pack_int32(values, bits, dim=0), pack_int32(values.t().contiguous(), bits).t())


def test_out_of_range_values_are_rejected_in_any_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.zeros(10, 8, dtype=torch.int8)
    values[9, 3] = 8  # outside signed 4-bit, in the last chunk
    monkeypatch.setattr(pack, "_CHUNK_ELEMENTS", 16)
    with pytest.raises(ValueError, match="out of range"):
        pack_int32(values, 4)
