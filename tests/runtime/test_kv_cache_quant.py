"""8-bit KV cache (``kv_cache_dtype`` "int8" / "fp8"): quantizer round-trip bounds, byte accounting, the torch
backend's write/read paths against attention over the dequantized cache, and the engine on a tiny model (logits
close to the unquantized cache, same greedy tokens, prefix-cache hits and chunked prefill unchanged)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers.runtime import engine_logits, run_triton_interpreted

from quantkit.errors import QuantkitError
from quantkit.eval.logit_metrics import token_kl
from quantkit.runtime.attention_backend import AttentionMetadata, TorchAttentionBackend, prefill_attention
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.engine import Engine
from quantkit.runtime.kv_cache import (
    QUANT_FORMATS,
    KVCache,
    LayerKV,
    bytes_per_block,
    check_kv_cache_dtype,
    dequantize,
    gather_pages,
    kv_rotation,
    quantize_rows,
)
from quantkit.runtime.sampling_params import SamplingParams

FORMATS = ["int8", "fp8"]
VOCAB = 256


def roundtrip_bound(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """int8: half a quantum (scale / 2); fp8 e4m3: half an ulp, 2^-4 relative (2^-10 * scale when subnormal)."""
    s = scale.float().unsqueeze(-1)
    bound = s / 2 if fmt == "int8" else torch.maximum(x.float().abs() * 2.0**-4, s * 2.0**-10)
    return bound * (1 + 1e-5) + 1e-7  # float32 arithmetic of the dequantize


# ------------------------------------------------------------------------------------ quantizer


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_roundtrip_error_bounds(fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-6, 1e-3, 0.05, 1.0, 7.0, 300.0]).repeat_interleave(8)
    x = (torch.randn(len(magnitudes), 3, 64, generator=gen) * magnitudes[:, None, None]).to(dtype)
    x[0, 0] = 0.0  # an all-zero row
    x[1, 1, 5] = 40.0  # one outlier dominates its row's scale
    values, scale = quantize_rows(x, QUANT_FORMATS[fmt][0])
    assert values.dtype == QUANT_FORMATS[fmt][0] and values.shape == x.shape
    assert scale.dtype == torch.float16 and scale.shape == x.shape[:-1]
    deq = dequantize(values, scale, torch.float32)
    assert ((deq - x.float()).abs() <= roundtrip_bound(x, scale, fmt)).all()
    assert (deq[0, 0] == 0).all()
    # the scale is absmax / qmax rounded up to float16 (never below it: nothing clips), within 0.2%
    qmax = QUANT_FORMATS[fmt][1]
    ideal = (x.float().abs().amax(-1) / qmax).clamp_min(2.0**-14)
    assert (scale.float() >= ideal).all() and (scale.float() <= ideal * (1 + 2.0**-9)).all()
    assert float(values.float().abs().max()) <= qmax


def test_rotation_is_orthogonal_and_spreads_outlier_channels():
    """Keys with a few large channels (as real models' keys have) lose most of their other channels' precision
    to a per-row scale; stored rotated, the int8 round trip's error is several times smaller."""
    d = 64
    rotation = kv_rotation(d, torch.device("cpu"))
    assert torch.allclose(rotation @ rotation.T, torch.eye(d), atol=1e-6)
    assert kv_rotation(d, torch.device("cpu")) is rotation  # built once per (head_dim, device)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(512, 3, d, generator=gen)
    k[..., [5, 37]] *= 40.0  # two outlier channels
    plain = dequantize(*quantize_rows(k, torch.int8), torch.float32) - k
    turned = dequantize(*quantize_rows(k @ rotation, torch.int8), torch.float32) @ rotation.T - k
    assert float(turned.square().mean()) < float(plain.square().mean()) / 4


def test_bad_kv_cache_dtype_is_refused_naming_the_valid_ones():
    for bad in ("int4", "bf16", "float8"):
        with pytest.raises(QuantkitError, match=r"kv_cache_dtype=.*'auto', 'int8', 'fp8'"):
            EngineConfig(kv_cache_dtype=bad)
        with pytest.raises(QuantkitError, match=r"'auto', 'int8', 'fp8'"):
            check_kv_cache_dtype(bad)


# ------------------------------------------------------------------------------------ byte accounting


def test_bytes_per_block_counts_scales_and_8bit_holds_twice_bf16():
    layers, block, heads, d = 30, 16, 3, 64  # SmolLM2-135M
    bf16 = bytes_per_block(layers, block, heads, d, torch.bfloat16)
    assert bf16 == 2 * layers * block * heads * d * 2
    for fmt in FORMATS:
        q8 = bytes_per_block(layers, block, heads, d, torch.bfloat16, fmt)
        assert q8 == 2 * layers * block * heads * (d + 2)  # 1 byte per value + a float16 scale per (slot, head)
        assert bytes_per_block(layers, block, heads, d, torch.float32, fmt) == q8  # independent of compute dtype
        memory = 256 * 1024**2
        cfg, cfg8 = EngineConfig(kv_cache_memory=memory), EngineConfig(kv_cache_memory=memory, kv_cache_dtype=fmt)
        blocks_bf16, blocks_8 = cfg.num_blocks(bf16), cfg8.num_blocks(q8)
        assert blocks_8 / blocks_bf16 >= 1.9  # 128 / 66 = 1.94
        fp32 = EngineConfig(kv_cache_memory=memory).num_blocks(bytes_per_block(layers, block, heads, d, torch.float32))
        assert blocks_8 / fp32 >= 3.8
        cache = KVCache(2, 5, block, heads, d, torch.bfloat16, fmt)
        assert cache.nbytes == 5 * bytes_per_block(2, block, heads, d, torch.bfloat16, fmt)
    auto = KVCache(2, 5, block, heads, d, torch.bfloat16)
    assert auto.scales is None and auto.values.dtype == torch.bfloat16 and auto.layer(1).k_scale is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_sizes_the_cache_in_bytes(tiny_model_dir: Path, fmt):
    memory = 64 * 1024
    opts = {"block_size": 4, "max_model_len": 64, "kv_cache_memory": memory}
    auto, q8 = Engine(tiny_model_dir, **opts), Engine(tiny_model_dir, kv_cache_dtype=fmt, **opts)
    assert auto.runner.cache.scales is None and auto.runner.kv_cache.dtype == torch.float32
    assert q8.runner.kv_cache.dtype == QUANT_FORMATS[fmt][0] and q8.runner.cache.scales.dtype == torch.float16
    n_auto, n_q8 = auto.block_manager.num_blocks, q8.block_manager.num_blocks
    assert n_q8 == memory // q8.runner.cache.bytes_per_block and q8.runner.cache.nbytes <= memory
    assert n_q8 / n_auto >= 3.5  # fp32 compute on CPU, head_dim 16: 64 / (16 + 2)
    attn = q8.model.model.layers[1].self_attn
    assert attn.kv.k_scale is not None and attn.kv.k_scale.data_ptr() == q8.runner.cache.scales[0, 1].data_ptr()
    assert torch.equal(attn.kv.rotation, kv_rotation(16, torch.device("cpu")))  # keys stored rotated
    assert auto.model.model.layers[1].self_attn.kv.rotation is None and not auto.runner.cache.layer(1).quantized


# ------------------------------------------------------------------------------------ torch backend


def _meta(query_lens, ctx_lens, tables, block_size, is_prefill):
    slots = []
    for n, ctx, table in zip(query_lens, ctx_lens, tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        query_lens=list(query_lens),
        context_lens_list=list(ctx_lens),
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_backend_reads_what_it_wrote(fmt):
    """Write a prefix, then a chunk (prefill over a cached prefix), then decode: each equals attention over the
    dequantized cache computed without scales, and stays close to the float cache."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, nb = 4, 2, 32, 4, 12
    tables = [[3, 7, 1, 9], [0, 5, 11]]
    backend = TorchAttentionBackend()
    rotation = kv_rotation(d, torch.device("cpu"))
    cache = KVCache(1, nb, bs, hkv, d, torch.float32, fmt)
    kv = cache.layer(0)
    kc, vc, ks, vs = kv.k, kv.v, kv.k_scale, kv.v_scale
    ref = LayerKV(torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d))  # float cache

    def step(query_lens, ctx_lens, is_prefill):
        meta = _meta(query_lens, ctx_lens, tables, bs, is_prefill)
        t = sum(query_lens)
        q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
        out = backend.forward(q, k, v, kv, meta, d**-0.5)
        # the same step on a float cache holding the dequantized values (keys rotated), with rotated queries:
        # identical math without scales
        deq_k, deq_v = dequantize(kc, ks, torch.float32), dequantize(vc, vs, torch.float32)
        fresh_k = deq_k.view(-1, hkv, d)[meta.slot_mapping]
        fresh_v = deq_v.view(-1, hkv, d)[meta.slot_mapping]
        qr = q @ rotation
        if is_prefill:
            want = prefill_attention(qr, fresh_k, fresh_v, LayerKV(deq_k, deq_v), meta, d**-0.5)
        else:
            want = TorchAttentionBackend().decode(qr, LayerKV(deq_k, deq_v), meta, d**-0.5)
        assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)
        # and close to the float cache
        TorchAttentionBackend().write_kv(k, v, ref, meta)
        exact = (
            prefill_attention(q, k, v, ref, meta, d**-0.5)
            if is_prefill
            else TorchAttentionBackend().decode(q, ref, meta, d**-0.5)
        )
        tol = 0.03 if fmt == "int8" else 0.12
        assert float((out - exact).abs().max() / exact.abs().max()) < tol

    step([6, 5], [6, 5], True)  # fresh prefill: reads the quantized pages back
    step([7, 3], [13, 8], True)  # a chunk over a cached prefix
    step([1, 1], [14, 9], False)  # decode
    step([1, 1], [15, 10], False)
    pages = torch.tensor([3, 7])
    assert gather_pages(kc, ks, pages, torch.float32).shape == (2, bs, hkv, d)


# ------------------------------------------------------------------------------------ engine


def _engine(path: Path, **kw) -> Engine:
    opts = {"num_kv_blocks": 128, "block_size": 4, "max_model_len": 64, "max_num_batched_tokens": 64, **kw}
    return Engine(path, **opts)


def _generate_with_logits(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits row each step sampled from (prefill's last row, then each decode step)."""
    rows: list[torch.Tensor] = []
    real = engine.model.compute_logits

    def record(hidden):
        logits = real(hidden)
        rows.append(logits[-1].clone())
        return logits

    engine.model.compute_logits = record
    try:
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens = out.token_ids
    finally:
        del engine.model.compute_logits
    return tokens, rows


PROMPTS = [[1, 17, 80, 33, 140, 5, 61, 200, 9, 44, 12], [1, 99, 3, 250, 17, 17, 60]]


# measured on this model: int8 KL max 6e-7, max |logit diff| 2.5e-3; fp8 7e-6, 1.3e-2 (logit std 0.17)
@pytest.mark.parametrize(("fmt", "kl_max", "diff_max"), [("int8", 5e-6, 0.01), ("fp8", 5e-5, 0.05)])
def test_engine_logits_and_greedy_tokens_close_to_unquantized(tiny_model_dir: Path, fmt, kl_max, diff_max):
    auto, q8 = _engine(tiny_model_dir), _engine(tiny_model_dir, kv_cache_dtype=fmt)
    # prefill: logits at every position of a 40-token prompt (read back from the 8-bit pages)
    ids = [1, *(random.Random(0).randrange(3, VOCAB) for _ in range(39))]
    ref, got = engine_logits(auto, ids), engine_logits(q8, ids)
    kl = token_kl(ref, got)
    assert float(kl.mean()) < kl_max / 4 and float(kl.max()) < kl_max
    diff = (ref - got).abs().amax(dim=-1)
    assert float(diff.max()) < diff_max
    # a random tiny model has near-ties: the top-1 agrees wherever the reference's top-2 margin exceeds the noise
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * diff
    assert torch.equal(ref.argmax(-1)[clear], got.argmax(-1)[clear])
    assert float((ref.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.9
    # decode: the same greedy tokens, and the logits of every decode step close
    for prompt in PROMPTS:
        tokens_ref, rows_ref = _generate_with_logits(auto, prompt, 12)
        tokens, rows = _generate_with_logits(q8, prompt, 12)
        assert tokens[:8] == tokens_ref[:8]
        same = next((i for i, (a, b) in enumerate(zip(tokens, tokens_ref, strict=True)) if a != b), len(tokens))
        for a, b in zip(rows_ref[: same + 1], rows[: same + 1], strict=True):
            assert float(token_kl(a, b)) < kl_max and float((a - b).abs().max()) < diff_max


def _requests(n: int, seed: int, shared_prefix: int = 0) -> list:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    return [
        ([1, *prefix, *(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 24)))], SamplingParams(max_tokens=8))
        for _ in range(n)
    ]


def _run(engine: Engine, requests, arrivals: list[int]) -> list:
    ids: dict[str, int] = {}
    results: dict[int, object] = {}
    step = 0
    while len(results) < len(requests):
        for i, at in enumerate(arrivals):
            if at == step:
                prompt, params = requests[i]
                params.temperature = 0.0
                ids[engine.add_request(prompt, params)] = i
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out
        step += 1
        assert step < 10_000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [results[i] for i in range(len(requests))]


def test_int8_prefix_cache_hits_change_nothing(tiny_model_dir: Path) -> None:
    requests = _requests(8, seed=1, shared_prefix=14)  # 15 shared tokens: 3 full blocks of 4
    arrivals = [0, *range(3, 10)]
    off = _run(_engine(tiny_model_dir, kv_cache_dtype="int8", enable_prefix_caching=False), requests, arrivals)
    on = _run(_engine(tiny_model_dir, kv_cache_dtype="int8"), requests, arrivals)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert all(o.num_cached_tokens >= 12 for o in on[1:])


def test_int8_chunked_prefill_changes_nothing(tiny_model_dir: Path) -> None:
    requests = _requests(8, seed=2)
    arrivals = [i // 2 for i in range(8)]
    whole = _run(_engine(tiny_model_dir, kv_cache_dtype="int8"), requests, arrivals)
    chunked = _engine(tiny_model_dir, kv_cache_dtype="int8", enable_chunked_prefill=True, max_num_batched_tokens=8)
    assert [o.token_ids for o in _run(chunked, requests, arrivals)] == [o.token_ids for o in whole]


_TRITON_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from quantkit.runtime.engine import Engine
from quantkit.runtime.sampling_params import SamplingParams
prompts = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
out = {}
for backend in ("torch", "triton"):
    engine = Engine(sys.argv[1], backend=backend, kv_cache_dtype="int8", num_kv_blocks=32, block_size=4,
                    max_model_len=64, max_num_batched_tokens=64)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
    res = {}
    while engine.has_unfinished():
        res.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    out[backend] = [res[i] for i in ids]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_backend_int8_cache_matches_torch_backend(tiny_model_dir: Path) -> None:
    """The quantizing kv_cache_write and dequantizing paged_attention kernels (CPU interpreter) give the torch
    backend's tokens with an int8 cache. (fp8 is not run here: the interpreter mis-rounds float32 -> fp8, see
    tests/runtime/kernels/test_kv_quant_kernels.py.)"""
    out = run_triton_interpreted(_TRITON_SCRIPT, str(tiny_model_dir))
    assert out["triton"] == out["torch"]
