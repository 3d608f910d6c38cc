"""kv_cache_write (Triton, interpreter on CPU): exact placement vs the index_copy reference."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)

from quantkit.runtime.kernels.kv_cache_write import kv_cache_write, kv_cache_write_reference


@pytest.mark.parametrize(
    ("heads", "d", "dtype"), [(2, 16, torch.float16), (3, 32, torch.float32), (2, 16, torch.bfloat16)]
)
def test_writes_exactly(device, heads, d, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, tokens = 6, 4, 9
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # padding tokens are skipped
    k = torch.randn(tokens, heads, d, generator=gen).to(dtype)
    v = torch.randn(tokens, heads, d, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, d, generator=gen).to(dtype)
    k, v, k_cache, v_cache, slots = (t.to(device) for t in (k, v, k_cache, v_cache, slots))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    before_k, before_v = k_cache.clone(), v_cache.clone()

    kv_cache_write(k, v, k_cache, v_cache, slots)
    kv_cache_write_reference(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # spot-check placement and that untouched slots keep their values
    flat_k, flat_v = k_cache.view(-1, heads, d), v_cache.view(-1, heads, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, heads, d)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, heads, d)[untouched])


def test_casts_to_cache_dtype_and_strided_input(device):
    k = torch.randn(4, 2, 3, 16, device=device)[:, :, 1]  # non-contiguous token/head strides
    v = torch.randn(4, 2, 16, device=device)
    k_cache = torch.zeros(2, 4, 2, 16, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([7, -1, 0, 3], device=device)
    kv_cache_write(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    kv_cache_write_reference(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_rejects_bad_inputs(device):
    k = torch.randn(3, 2, 16, device=device)
    cache = torch.zeros(2, 4, 2, 16, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache_write(k, k, cache, cache.clone(), torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="do not match"):
        kv_cache_write(k[:, :1], k[:, :1], cache, cache.clone(), torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="k and v"):
        kv_cache_write(k, k[:2], cache, cache.clone(), torch.zeros(3, dtype=torch.int64, device=device))
