"""What each GGML type decodes to, as a grid: which weights share an effective scale (and offset), the levels a code
stands for, and the integer ranges of the stored parameter codes. Read from llama.cpp's ``dequantize_row_*``
(ggml-quants.c) and the gguf package's dequantizers.

Every type decodes a weight as ``w = s * level - o`` on the sub-block it belongs to, with

- K-quants: ``s = fp32(d) * sc`` and ``o = fp32(dmin) * m`` (Q2_K, Q4_K, Q5_K; ``o = 0`` for Q3_K, Q6_K), where
  ``d``/``dmin`` are one fp16 pair per super-block of 256 and ``sc``/``m`` one integer code per sub-block;
- 32-blocks: ``s = fp32(d)`` (``o = -fp32(m)`` for Q4_1/Q5_1, whose stored formula ``d * q + m`` is the same number);
- ``level = code - code_offset`` on uniform grids, ``level = codebook[code]`` for IQ4_NL.

The products are the dequantizers' own float32 operations in their order, so ``s * level - o`` computed in float32
is bit-identical to what llama.cpp and ``gguf.quants.dequantize`` produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.ggml.types import GGML_TYPES, GGMLType

# llama.cpp's kvalues_iq4nl (ggml-common.h): IQ4_NL's 16 non-uniform levels
IQ4NL_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True, slots=True)
class GGMLGrid:
    type: GGMLType
    sub: int  # consecutive weights of a row that share one effective scale (and offset)
    lo: int  # lowest level (codebook: lowest code)
    hi: int  # highest level (codebook: highest code)
    code_offset: int = 0  # stored code = level + code_offset (Q8_0: the level's int8 bit pattern)
    codebook: tuple[int, ...] | None = None  # IQ4_NL: level = codebook[code]
    affine: bool = False  # an offset o per sub-block (a stored min)
    scale_codes: tuple[int, int] | None = None  # K-quants: range of the sub-block scale code sc
    min_codes: tuple[int, int] | None = None  # Q2_K/Q4_K/Q5_K: range of the sub-block min code m

    @property
    def name(self) -> str:
        return self.type.name

    @property
    def per_block(self) -> int:
        """Sub-blocks per stored block (8 or 16 for K-quants, 1 for 32-blocks)."""
        return self.type.block // self.sub

    @property
    def level_values(self) -> torch.Tensor:
        """float32 [codes]: the level each code stands for."""
        if self.codebook is not None:
            return torch.tensor(self.codebook, dtype=torch.float32)
        return torch.arange(self.lo, self.hi + 1, dtype=torch.float32)


def _grid(name: str, sub: int, lo: int, hi: int, **kw: object) -> GGMLGrid:
    return GGMLGrid(GGML_TYPES[name], sub, lo, hi, **kw)  # type: ignore[arg-type]


GGML_GRIDS: dict[str, GGMLGrid] = {
    g.name: g
    for g in (
        _grid("Q2_K", 16, 0, 3, affine=True, scale_codes=(0, 15), min_codes=(0, 15)),
        _grid("Q3_K", 16, -4, 3, code_offset=4, scale_codes=(-32, 31)),
        _grid("Q4_K", 32, 0, 15, affine=True, scale_codes=(0, 63), min_codes=(0, 63)),
        _grid("Q5_K", 32, 0, 31, affine=True, scale_codes=(0, 63), min_codes=(0, 63)),
        _grid("Q6_K", 16, -32, 31, code_offset=32, scale_codes=(-128, 127)),
        _grid("Q4_0", 32, -8, 7, code_offset=8),
        _grid("Q4_1", 32, 0, 15, affine=True),
        _grid("Q5_0", 32, -16, 15, code_offset=16),
        _grid("Q5_1", 32, 0, 31, affine=True),
        _grid("Q8_0", 32, -127, 127),  # llama.cpp never writes -128 (its reference rounds amax to 127)
        _grid("IQ4_NL", 32, 0, 15, codebook=IQ4NL_VALUES),
    )
}


@dataclass(slots=True)
class GGMLParams:
    """A tensor's stored parameters, as the codes llama.cpp keeps (B blocks of ``type.block`` per row)."""

    d: torch.Tensor  # float16 [N, B]: the super-block scale (K-quants) or the block's scale
    dmin: torch.Tensor | None = None  # float16 [N, B]: K-quants' scale of mins; Q4_1/Q5_1: the block's m
    sc: torch.Tensor | None = None  # int16 [N, B * per_block]: K-quants' sub-block scale codes
    mn: torch.Tensor | None = None  # int16 [N, B * per_block]: Q2_K/Q4_K/Q5_K sub-block min codes


def effective(grid: GGMLGrid, params: GGMLParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 ``(s, o)`` [N, K / sub], computed with the dequantizer's operations (o None: no offset)."""
    d = params.d.float()
    if grid.scale_codes is None:  # 32-blocks: the block's own fp16 numbers
        return d, None if params.dmin is None else -params.dmin.float()
    assert params.sc is not None
    s = d.repeat_interleave(grid.per_block, dim=1) * params.sc.float()
    if params.mn is None or params.dmin is None:
        return s, None
    return s, params.dmin.float().repeat_interleave(grid.per_block, dim=1) * params.mn.float()


def levels_of(grid: GGMLGrid, codes: torch.Tensor) -> torch.Tensor:
    """float32 levels of stored codes (uint8, any shape)."""
    if grid.codebook is not None:
        return grid.level_values[codes.long()]
    if grid.name == "Q8_0":
        return codes.view(torch.int8).float()
    return codes.float() - grid.code_offset


def codes_of(grid: GGMLGrid, levels: torch.Tensor) -> torch.Tensor:
    """uint8 stored codes of float32 levels that lie on the grid (the inverse of :func:`levels_of`)."""
    if grid.codebook is not None:
        return torch.searchsorted(grid.level_values, levels.contiguous()).to(torch.uint8)
    if grid.name == "Q8_0":
        return levels.to(torch.int8).view(torch.uint8)
    return (levels + grid.code_offset).to(torch.uint8)


def dequantize(grid: GGMLGrid, params: GGMLParams, codes: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: what llama.cpp decodes from ``params`` and ``codes`` (uint8 [N, K]), bit for bit."""
    n, k = codes.shape
    s, o = effective(grid, params)
    w = s.reshape(n, -1, 1) * levels_of(grid, codes).reshape(n, -1, grid.sub)
    if o is not None:
        w = w - o.reshape(n, -1, 1)
    return w.reshape(n, k)
