"""GGML block formats: the type table against gguf's, and every byte layout against gguf's own dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.format.ggml.grids import GGML_GRIDS, GGMLParams, dequantize, effective
from quantkit.format.ggml.pack import encode
from quantkit.format.ggml.types import GGML_TYPES, fits, ggml_type, row_bytes

NAMES = list(GGML_TYPES)


def test_type_table_matches_gguf_sizes() -> None:
    for name, t in GGML_TYPES.items():
        assert t.qtype == gguf.GGMLQuantizationType[name]
        assert (t.block, t.block_bytes) == gguf.GGML_QUANT_SIZES[t.qtype]
    assert GGML_TYPES["Q4_K"].bits_per_weight == 4.5
    assert GGML_TYPES["Q6_K"].bits_per_weight == 6.5625
    assert GGML_TYPES["Q8_0"].bits_per_weight == 8.5
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"} <= set(NAMES)


def test_lookup_fits_and_row_bytes() -> None:
    assert ggml_type("q4_k") is GGML_TYPES["Q4_K"]
    assert ggml_type(" iq4_nl ") is GGML_TYPES["IQ4_NL"]
    with pytest.raises(QuantkitError, match="Q4_K"):  # the message lists the known types
        ggml_type("Q4_K_M")
    q4k, q8 = GGML_TYPES["Q4_K"], GGML_TYPES["Q8_0"]
    assert fits(q4k, 1536) and not fits(q4k, 576) and fits(q8, 576) and not fits(q8, 0)
    assert row_bytes(q4k, 1536) == 6 * 144
    assert row_bytes(q8, 576) == 18 * 34
    with pytest.raises(QuantkitError, match=r"not a multiple of Q4_K's block of 256"):
        row_bytes(q4k, 576)


def _random_params(name: str, n: int, k: int, gen: torch.Generator) -> tuple[GGMLParams, torch.Tensor]:
    grid = GGML_GRIDS[name]
    blocks = k // grid.type.block
    d = (torch.rand(n, blocks, generator=gen) * 0.2 - 0.05).half()  # both signs, as the formats allow
    dmin = (torch.rand(n, blocks, generator=gen) * 0.1).half() if grid.affine else None
    sc = mn = None
    if grid.scale_codes is not None:
        sc = torch.randint(grid.scale_codes[0], grid.scale_codes[1] + 1, (n, k // grid.sub), generator=gen)
        sc = sc.to(torch.int16)
    if grid.min_codes is not None:
        mn = torch.randint(grid.min_codes[0], grid.min_codes[1] + 1, (n, k // grid.sub), generator=gen)
        mn = mn.to(torch.int16)
    if grid.name == "Q8_0":
        codes = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8).view(torch.uint8)
    else:
        top = 15 if grid.codebook is not None else grid.hi - grid.lo
        codes = torch.randint(0, top + 1, (n, k), generator=gen).to(torch.uint8)
    return GGMLParams(d, dmin, sc, mn), codes


@pytest.mark.parametrize("name", NAMES)
def test_every_layout_decodes_bit_exact_through_gguf(name: str) -> None:
    """Random stored parameters and codes (every code value, every scale code, both signs of d) packed by quantkit
    decode in the gguf package's dequantizer to exactly the numbers quantkit's grid says."""
    gen = torch.Generator().manual_seed(NAMES.index(name))
    n, k = 5, 768
    params, codes = _random_params(name, n, k, gen)
    t = GGML_TYPES[name]
    data = encode(t, params, codes.numpy())
    assert data.dtype == np.uint8 and data.shape == (n, row_bytes(t, k))
    theirs = gguf.quants.dequantize(data, t.qtype)
    ours = dequantize(GGML_GRIDS[name], params, codes).numpy()
    assert theirs.dtype == ours.dtype == np.float32
    assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32))


def test_effective_scales_are_the_decoded_products() -> None:
    """Q4_K: s = fp32(d) * sc and o = fp32(dmin) * m per sub-block of 32 (what llama.cpp multiplies)."""
    gen = torch.Generator().manual_seed(7)
    params, _ = _random_params("Q4_K", 2, 512, gen)
    s, o = effective(GGML_GRIDS["Q4_K"], params)
    assert s.shape == (2, 16) and o is not None
    assert params.sc is not None and params.mn is not None and params.dmin is not None
    assert float(s[1, 9]) == float(params.d[1, 1].float() * params.sc[1, 9].float())
    assert float(o[0, 3]) == float(params.dmin[0, 0].float() * params.mn[0, 3].float())
