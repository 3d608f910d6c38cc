"""8-bit KV cache in the Triton kernels (interpreter on CPU): kv_cache_write quantizes each (token, head) row as
``kv_cache.quantize_rows`` does, and paged_attention dequantizes in-kernel like attention over the dequantized
cache.

On CPU the interpreter's float32 division is IEEE, so the stored bytes and scales equal the torch reference
exactly; on a GPU Triton's fast division may move a value by one quantum, so there the check is one quantum (and
the round-trip bound) instead.

fp8 on CPU: the interpreter reads float8_e4m3fn exactly (every byte decodes as torch does), so the fp8
``paged_attention`` read path is tested here. Its float32 -> float8e4nv *conversion* is not a correct
round-to-nearest-even (Triton 3.x's numpy emulation drops the mantissa carry: 125.0 becomes 64.0, 0.0155 becomes
0.0078), so the fp8 ``kv_cache_write`` test is skipped under the interpreter when a probe shows that bug; GPUs
convert in hardware (``cvt.rn.satfinite``) and run it. The fp8 write math itself is tested in the torch backend
(tests/runtime/test_kv_cache_quant.py) with the same quantizer.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)

from quantkit.runtime.kernels.kv_cache_write import kv_cache_write
from quantkit.runtime.kernels.paged_attention import paged_attention, paged_attention_reference
from quantkit.runtime.kv_cache import QUANT_FORMATS, dequantize, write_rows

FORMATS = ["int8", "fp8"]


def _cache(num_blocks, block_size, heads, d, fmt, device):
    dtype = QUANT_FORMATS[fmt][0]
    values = torch.zeros(num_blocks, block_size, heads, d, dtype=dtype, device=device)
    scales = torch.zeros(num_blocks, block_size, heads, dtype=torch.float16, device=device)
    return values, scales


def _interpreter_fp8_cast_is_broken(device: str) -> bool:
    """Probe: a row whose scaled value 124.88 must round to 128 in e4m3 (the interpreter gives 64)."""
    if device != "cpu":
        return False
    row = torch.tensor([[[448.0, 125.0] + [0.0] * 14]])  # [T=1, H=1, D=16]
    kc, ks = _cache(1, 1, 1, 16, "fp8", device)
    kv_cache_write(row, row, kc, kc.clone(), torch.tensor([0]), k_scale=ks, v_scale=ks.clone())
    return float(kc[0, 0, 0, 1].float()) != 128.0


def _roundtrip_ok(deq: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, fmt: str) -> bool:
    err = (deq.float() - x.float()).abs()
    s = scale.float().unsqueeze(-1)
    # int8: half a quantum; e4m3: half an ulp (2^-4 relative), or 2^-10 * scale in its subnormal range
    bound = s / 2 if fmt == "int8" else torch.maximum(x.float().abs() * 2.0**-4, s * 2.0**-10)
    return bool((err <= bound * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("heads", "d", "dtype"), [(2, 16, torch.float32), (3, 32, torch.bfloat16)])
def test_quantized_write_matches_torch(device, fmt, heads, d, dtype):
    if fmt == "fp8" and _interpreter_fp8_cast_is_broken(device):
        pytest.skip("the Triton CPU interpreter mis-rounds float32 -> float8e4nv (125.0 -> 64.0); GPU-only check")
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, tokens = 6, 4, 9
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # padding tokens are skipped
    k = (torch.randn(tokens, heads, d, generator=gen) * 3).to(dtype)
    v = torch.randn(tokens, heads, d, generator=gen).to(dtype)
    k[0, 0] = 0.0  # an all-zero row: smallest scale, zeros back
    v[1, 1] *= 1e-4  # a tiny row
    kc, ks = _cache(num_blocks, block_size, heads, d, fmt, "cpu")
    vc, vs = _cache(num_blocks, block_size, heads, d, fmt, "cpu")
    k, v, slots = k.to(device), v.to(device), slots.to(device)
    kc, ks, vc, vs = (t.to(device) for t in (kc, ks, vc, vs))
    ref = [t.clone() for t in (kc, ks, vc, vs)]

    kv_cache_write(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    keep = slots >= 0
    write_rows(k[keep], ref[0], ref[1], slots[keep])
    write_rows(v[keep], ref[2], ref[3], slots[keep])

    flat = lambda t: t.reshape(num_blocks * block_size, *t.shape[2:])  # noqa: E731
    for out, expect, sc, sc_ref, x in ((kc, ref[0], ks, ref[1], k), (vc, ref[2], vs, ref[3], v)):
        if device == "cpu":
            assert torch.equal(out.view(torch.uint8), expect.view(torch.uint8)) and torch.equal(sc, sc_ref)
        else:
            assert torch.allclose(sc.float(), sc_ref.float(), rtol=2e-3)
            a, b = dequantize(out, sc, torch.float32), dequantize(expect, sc_ref, torch.float32)
            s_ref = sc_ref.float().unsqueeze(-1)
            step = s_ref * 1.01 if fmt == "int8" else b.abs() * 2.0**-3 + s_ref * 2.0**-9  # one quantum / e4m3 ulp
            assert ((a - b).abs() <= step).all()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                deq = dequantize(flat(out)[s], flat(sc)[s], torch.float32)
                assert _roundtrip_ok(deq, x[t], flat(sc)[s], fmt)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
        untouched[slots[keep]] = False
        assert (flat(out).view(torch.uint8)[untouched] == 0).all() and (flat(sc)[untouched] == 0).all()
    assert (flat(kc).view(torch.uint8)[slots[0], 0] == 0).all()  # the zero row


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (6, 2, 16)])
def test_quantized_paged_attention_matches_dequantized_reference(device, fmt, hq, hkv, d):
    gen = torch.Generator().manual_seed(2)
    context_lens, block_size = [5, 71, 32], 16
    bsz = len(context_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens) + 1
    num_blocks = bsz * max_blocks + 3
    q = torch.randn(bsz, hq, d, generator=gen)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=gen) * 2
    v = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    kc, ks = _cache(num_blocks, block_size, hkv, d, fmt, "cpu")
    vc, vs = _cache(num_blocks, block_size, hkv, d, fmt, "cpu")
    all_slots = torch.arange(num_blocks * block_size)
    write_rows(k.flatten(0, 1), kc, ks, all_slots)
    write_rows(v.flatten(0, 1), vc, vs, all_slots)
    bt = torch.randperm(num_blocks, generator=gen)[: bsz * max_blocks].reshape(bsz, max_blocks).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q, kc, ks, vc, vs, bt, lens = (t.to(device) for t in (q, kc, ks, vc, vs, bt, lens))
    scale = d**-0.5

    k_deq, v_deq = dequantize(kc, ks, torch.float32), dequantize(vc, vs, torch.float32)
    ref = paged_attention_reference(q, k_deq, v_deq, bt, lens, scale)
    for kw in ({}, {"partition_size": 32, "block_n": 16}):  # one partition, several + merge
        out = paged_attention(q, kc, vc, bt, lens, scale, k_scale=ks, v_scale=vs, **kw)
        assert out.dtype == q.dtype and out.shape == ref.shape
        assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
    # and close to attention over the float (unquantized) cache
    exact = paged_attention_reference(q, k.to(device), v.to(device), bt, lens, scale)
    tol = 0.02 if fmt == "int8" else 0.1
    assert float((out - exact).abs().max() / exact.abs().max()) <= tol


def test_quantized_kernels_reject_bad_scales(device):
    k = torch.randn(3, 2, 16, device=device)
    kc, ks = _cache(2, 4, 2, 16, "int8", device)
    slots = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="both"):
        kv_cache_write(k, k, kc, kc.clone(), slots, k_scale=ks)
    with pytest.raises(ValueError, match="float16"):
        kv_cache_write(k, k, kc, kc.clone(), slots, k_scale=ks.float(), v_scale=ks.float())
    with pytest.raises(ValueError, match="8-bit"):
        kv_cache_write(k, k, kc.float(), kc.float(), slots, k_scale=ks, v_scale=ks.clone())
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):  # an 8-bit cache without scales
        kv_cache_write(k, k, kc, kc.clone(), slots)
    q = torch.randn(1, 4, 16, device=device)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="float16"):
        paged_attention(q, kc, kc.clone(), bt, lens, 1.0, k_scale=ks[:, :2], v_scale=ks.clone())
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q, kc, kc.clone(), bt, lens, 1.0)
