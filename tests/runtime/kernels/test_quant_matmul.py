"""quant_matmul (Triton, interpreter on CPU) vs the plain-torch reference.

Tolerance: max|out - ref| / max|ref| <= 1e-5 (fp32), 4e-3 (fp16), 2e-2 (bf16); the reference dequantizes
and multiplies in fp32 and rounds once, the kernel may round the dequantized weight to x's dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)

from quantkit.format.pack import pack_int32
from quantkit.runtime.kernels.quant_matmul import (
    QuantMatmulConfig,
    default_config,
    quant_matmul,
    quant_matmul_reference,
)

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def make_weight(n: int, k: int, bits: int, group_size: int, symmetric: bool, act_order: bool, seed: int = 0):
    """Random packed weight in the checkpoint layout: (packed, scale fp32, zero_packed | None, g_idx | None)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    group = k if group_size == -1 else group_size
    n_groups = math.ceil(k / group)
    q = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int32)
    scale = torch.rand(n, n_groups, generator=gen) * 0.02 + 0.005
    zero = None if symmetric else pack_int32(torch.randint(lo, hi + 1, (n, n_groups), generator=gen), bits, dim=0)
    g_idx = None
    if act_order:  # groups of a random permutation of the columns (GPTQ act-order without static groups)
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    return pack_int32(q, bits), scale, zero, g_idx


CASES = [
    # bits, group, K, symmetric, act_order
    (4, 32, 128, True, False),
    (4, 64, 128, False, False),
    (4, -1, 96, True, False),
    (4, 64, 96, False, False),  # shorter last group
    (4, 32, 128, False, True),  # act-order
    (8, 32, 128, False, False),
    (8, -1, 96, False, False),
    (8, 64, 96, True, True),
]


@pytest.mark.parametrize(("bits", "group", "k", "symmetric", "act_order"), CASES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_matches_reference(device, bits, group, k, symmetric, act_order, m):
    n = 40 if m != 3 else 72
    packed, scale, zero, g_idx = make_weight(n, k, bits, group, symmetric, act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n) if m == 3 else None
    args = [t.to(device) if t is not None else None for t in (packed, scale.half(), zero, g_idx)]
    x, bias = x.to(device), bias.to(device) if bias is not None else None
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        out = quant_matmul(xd, *args, bits, group, bias=b)
        ref = quant_matmul_reference(xd, *args, bits, group, bias=b)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, ref) <= TOL[dtype], (dtype, rel_err(out, ref))


@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_and_split_k(device, bits):
    """bf16 activations/scales, explicit split-K and a small tile (several N and K tiles), batched leading dims."""
    n, k, group = 72, 256, 64
    packed, scale, zero, g_idx = make_weight(n, k, bits, group, symmetric=False, act_order=False, seed=3)
    args = [t.to(device) if t is not None else None for t in (packed, scale.bfloat16(), zero, g_idx)]
    x = torch.randn(2, 2, k).to(device=device, dtype=torch.bfloat16)
    bias = torch.randn(n).to(device=device, dtype=torch.bfloat16)
    ref = quant_matmul_reference(x, *args, bits, group, bias=bias)
    cfg = QuantMatmulConfig(block_m=16, block_n=32, block_k=32, split_k=4)
    out = quant_matmul(x, *args, bits, group, bias=bias, config=cfg)
    assert out.shape == (2, 2, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    # non-uniform (gather) path with bf16: block_k larger than the group
    out = quant_matmul(x, *args, bits, group, bias=bias, config=QuantMatmulConfig(16, 32, 128, split_k=2))
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


def test_rejects_bad_inputs(device):
    n, k, bits, group = 40, 128, 4, 32
    packed, scale, zero, _ = make_weight(n, k, bits, group, symmetric=False, act_order=False)
    packed, scale, zero = packed.to(device), scale.half().to(device), zero.to(device)
    x = torch.randn(2, k, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="words per row"):
        quant_matmul(x[:, :64], packed, scale, zero, None, bits, group)
    with pytest.raises(ValueError, match="bits"):
        quant_matmul(x, packed, scale, zero, None, 3, group)
    with pytest.raises(ValueError, match="int32"):
        quant_matmul(x, packed.to(torch.int64), scale, zero, None, bits, group)
    with pytest.raises(ValueError, match="x must be"):
        quant_matmul(x.to(torch.int32), packed, scale, zero, None, bits, group)
    with pytest.raises(ValueError, match="weight_scale"):
        quant_matmul(x, packed, scale[:, :2], zero, None, bits, group)
    with pytest.raises(ValueError, match="weight_zero_point"):
        quant_matmul(x, packed, scale, zero[:2], None, bits, group)
    with pytest.raises(ValueError, match="g_idx"):
        quant_matmul(x, packed, scale, zero, torch.zeros(k, dtype=torch.int64, device=device), bits, group)
    with pytest.raises(ValueError, match="bias"):
        quant_matmul(x, packed, scale, zero, None, bits, group, bias=torch.zeros(n + 1, device=device))
    with pytest.raises(ValueError, match="group_size"):
        quant_matmul(x, packed, scale, zero, None, bits, 0)


def test_default_config_keeps_group_uniform_tiles():
    cfg = default_config(1, 4096, 4096, 4, 128, False, torch.device("cpu"))
    assert 128 % cfg.block_k == 0 and cfg.block_m == 16
    cfg = default_config(1, 576, 576, 4, 32, False, torch.device("cpu"))
    assert cfg.block_k == 32
    cfg = default_config(512, 576, 1536, 8, 20, False, torch.device("cpu"))  # no power-of-two divisor of 20
    assert cfg.block_k == 64 and cfg.block_m == 128
