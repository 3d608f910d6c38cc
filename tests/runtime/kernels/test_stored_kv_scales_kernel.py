"""paged_attention over an FP8 cache under a checkpoint's stored scales (interpreter on CPU): each layer's float32
per-head scales reach the kernel broadcast over every slot (stride 0), as :class:`KVCache` hands them out, and the
kernel attends over ``code * scale`` as the torch decode does. The rows are written by torch
(:func:`write_under_stored_scales`): the write kernel computes per-row scales and is not used for this cache."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)

from quantkit.runtime.kernels.paged_attention import paged_attention, paged_attention_reference
from quantkit.runtime.kv_cache import KVCache, dequantize
from quantkit.runtime.kv_stored_scales import write_under_stored_scales


@pytest.mark.parametrize("per_head", [False, True])
def test_paged_attention_reads_an_fp8_cache_under_stored_scales(device, per_head):
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, block_size, num_blocks = 4, 2, 32, 16, 12
    context_lens = [5, 40, 17]
    heads = torch.tensor([0.03, 0.02]) if per_head else torch.full((hkv,), 0.025)
    stored = torch.stack([heads, heads * 1.5])[:, None, :]  # [2 (K, V), 1 layer, Hkv]
    cache = KVCache(1, num_blocks, block_size, hkv, d, torch.float32, "fp8", stored_scales=stored)
    kv = cache.layer(0)
    assert kv.k_scale is not None and kv.k_scale.stride() == (0, 0, 1)  # one scale per head, no copy per slot
    k = torch.randn(num_blocks * block_size, hkv, d, generator=gen) * 2
    v = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    assert kv.stored_scales is not None
    write_under_stored_scales(k, v, (kv.k, kv.v), kv.stored_scales, torch.arange(num_blocks * block_size))
    bsz = len(context_lens)
    bt = torch.randperm(num_blocks, generator=gen)[: bsz * 4].reshape(bsz, 4).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(bsz, hq, d, generator=gen)
    k_deq, v_deq = dequantize(kv.k, kv.k_scale, torch.float32), dequantize(kv.v, kv.v_scale, torch.float32)
    ref = paged_attention_reference(q, k_deq, v_deq, bt, lens, d**-0.5)
    dev = [t.to(device) for t in (q, kv.k, kv.v, bt, lens, kv.k_scale, kv.v_scale)]
    out = paged_attention(*dev[:5], d**-0.5, k_scale=dev[5], v_scale=dev[6])
    assert float((out.cpu() - ref).abs().max() / ref.abs().max()) <= 1e-5
    # the cache holds e4m3(x / scale): within e4m3's rounding of the float rows
    assert float(((k_deq.flatten(0, 1) - k) / k.abs().clamp(min=heads.max() * 2**-6)).abs().max()) <= 2.0**-4
