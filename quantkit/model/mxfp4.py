"""OpenAI's MXFP4 expert weights (the hub's gpt-oss checkpoints, config.json quant_method "mxfp4"), decoded to float.

Each ``*_blocks`` tensor is uint8 ``[..., G, 16]``: every byte holds two FP4 (E2M1) codes, the low nibble first, so
a group of 32 weights along the input dimension takes 16 bytes; ``*_scales`` is uint8 ``[..., G]``, one E8M0
exponent per group (the scale is 2^(s - 127)). A weight is its code's E2M1 value times its group's scale; every such
product is exact in bfloat16 and float32, so the decoded weights are the checkpoint's, not an approximation. This is
the layout transformers' ``integrations/mxfp4.py`` (``_convert_moe_packed_tensors``) and vLLM's gpt_oss loader read.
"""

from __future__ import annotations

import torch

# E2M1: sign bit, 2 exponent bits, 1 mantissa bit (codes 0-7 positive, 8-15 their negatives)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks`` uint8 [..., G, 16] and ``scales`` uint8 [..., G] -> ``dtype`` [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1).flatten(-2)
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)
