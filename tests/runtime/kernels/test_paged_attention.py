"""paged_attention (Triton, interpreter on CPU) vs the per-sequence reference and the batched torch path.

Tolerance: max|out - ref| / max|ref| <= 1e-5 (fp32), 5e-3 (fp16), 2e-2 (bf16): both sides compute in fp32 and
round once to q's dtype.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)

from quantkit.runtime.kernels.paged_attention import paged_attention, paged_attention_reference, paged_attention_torch

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def make_case(context_lens, hq, hkv, d, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bsz = len(context_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens) + 1  # one spare (padding) column
    num_blocks = bsz * max_blocks + 3
    q = torch.randn(bsz, hq, d, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    # random, non-contiguous pages; unused table entries hold garbage page ids
    block_tables = torch.randperm(num_blocks, generator=gen)[: bsz * max_blocks].reshape(bsz, max_blocks)
    block_tables = block_tables.to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, lens


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (4, 4, 16), (6, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(device, hq, hkv, d, dtype):
    # one context shorter than a block, one spanning several blocks, one ending exactly on a block boundary
    args = make_case([5, 71, 32], hq, hkv, d, block_size=16, dtype=dtype)
    args = [t.to(device) for t in args]
    scale = d**-0.5
    ref = paged_attention_reference(*args, scale)
    out = paged_attention(*args, scale)  # single partition
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) <= TOL[dtype]
    out_split = paged_attention(*args, scale, partition_size=32, block_n=16)  # several partitions + merge
    assert rel_err(out_split, ref) <= TOL[dtype]
    assert rel_err(paged_attention_torch(*args, scale), ref) <= TOL[dtype]


def test_empty_context_and_odd_block_size(device):
    """A sequence with no tokens yields zeros; block_size need not be a power of two."""
    q, kc, vc, bt, lens = (t.to(device) for t in make_case([0, 13, 20], 4, 2, 16, block_size=6, dtype=torch.float32))
    ref = paged_attention_reference(q, kc, vc, bt, lens, 0.25)
    for out in (
        paged_attention(q, kc, vc, bt, lens, 0.25),
        paged_attention(q, kc, vc, bt, lens, 0.25, partition_size=16),
    ):
        assert torch.all(out[0] == 0)
        assert rel_err(out, ref) <= TOL[torch.float32]
    assert rel_err(paged_attention_torch(q, kc, vc, bt, lens, 0.25), ref) <= TOL[torch.float32]


def test_rejects_bad_inputs(device):
    q, kc, vc, bt, lens = (t.to(device) for t in make_case([5, 9], 4, 2, 16, block_size=16, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], kc, vc, bt, lens, 1.0)
    with pytest.raises(ValueError, match="head dim"):
        paged_attention(q[..., :8], kc, vc, bt, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, kc, vc, bt.long(), lens, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention(q, kc, vc, bt, lens[:1], 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q, kc, vc.float(), bt, lens, 1.0)


@pytest.mark.parametrize("window", [1, 5, 16, 40, 500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_reference(device, window, dtype):
    """Each sequence attends to its last ``window`` keys, in one partition or in several (a partition wholly before
    the window contributes nothing to the merge)."""
    args = [t.to(device) for t in make_case([5, 71, 32], 4, 2, 32, block_size=16, dtype=dtype)]
    scale = 32**-0.5
    ref = paged_attention_reference(*args, scale, window=window)
    assert rel_err(paged_attention(*args, scale, window=window), ref) <= TOL[dtype]
    split = paged_attention(*args, scale, partition_size=32, block_n=16, window=window)  # three partitions of 71
    assert rel_err(split, ref) <= TOL[dtype]
    if window < 32:  # the window bites: attending to the whole context differs
        assert rel_err(paged_attention_reference(*args, scale), ref) > 1e-2
