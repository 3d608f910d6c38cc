"""Runtime layers against Hugging Face / plain-torch references: RMSNorm, rotary, quantized Linear, attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.runtime import paged_meta
from helpers.tiny import rtn_for_tests
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.runtime.attention_backend import AttentionMetadata, TorchAttentionBackend
from quantkit.runtime.kv_cache import LayerKV
from quantkit.runtime.layers import Linear, RMSNorm, RopeConfig, RotaryEmbedding, apply_rotary


def test_rmsnorm_matches_hf_with_fused_residual() -> None:
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    ref = LlamaRMSNorm(64, eps=1e-5)
    ref.weight.data = torch.randn(64)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = ref.weight.data.clone()
    assert torch.equal(norm(x), ref(x))
    out, new_res = norm(x, res)
    assert torch.equal(new_res, res + x) and torch.equal(out, ref(res + x))


@pytest.mark.parametrize(
    "cfg",
    [
        {"rope_theta": 100000.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ],
)
def test_rope_inv_freq_matches_transformers(cfg: dict) -> None:
    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256, **cfg)
    rope = RopeConfig.from_hf({"max_position_embeddings": 256, **cfg})
    params = hf.rope_parameters
    if params.get("rope_type", "default") == "default":
        expected = 1.0 / (params["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    assert torch.allclose(rope.inv_freq(32), expected, rtol=1e-6, atol=0)


def test_rope_rejects_unsupported_types() -> None:
    with pytest.raises(QuantkitError, match="longrope"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_rotary_matches_hf_apply() -> None:
    rotary = RotaryEmbedding(32, RopeConfig(theta=10000.0))
    rotary.build(64, "cpu")
    positions = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 4, 32), torch.randn(4, 2, 32)
    rope = rotary(positions, q.dtype)
    inv = RopeConfig(theta=10000.0).inv_freq(32)
    freqs = positions[:, None].float() * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    # HF layout: [B, H, T, D] with cos [B, T, D]
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    assert torch.equal(apply_rotary(q, rope), rq[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, rope), rk[0].transpose(0, 1))


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(bits=4, group_size=32),
        QuantScheme(bits=8, group_size=-1, symmetric=False),
        QuantScheme(bits=3, group_size=16, symmetric=False, act_order=True),
    ],
)
def test_quantized_linear_dequantizes_once_at_prepare(scheme: QuantScheme) -> None:
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    qw = rtn_for_tests(weight, scheme)
    with torch.device("meta"):
        layer = Linear(96, 40, bias=True)
        layer.quantize(scheme, torch.bfloat16)
    state = linear_tensors("", qw, torch.bfloat16)
    state["bias"] = torch.randn(40)
    layer.load_state_dict(state, strict=True, assign=True)
    layer.prepare(torch.float32, use_kernel=False)
    assert layer.scheme is None and not hasattr(layer, "weight_packed")
    assert torch.equal(layer.weight, qw.dequantize(torch.float32))
    x = torch.randn(3, 96)
    assert torch.allclose(layer(x), F.linear(x, qw.dequantize(), state["bias"]), atol=1e-6)


# --- attention over the paged cache ---------------------------------------------------------------

BS, HKV, HQ, D = 4, 2, 4, 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions [start, start + n) over keys [0, ctx); [n, Hq, D]."""
    n, ctx = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("nhd,thd->hnt", q, k) / math.sqrt(D)
    allowed = torch.arange(ctx)[None, :] <= torch.arange(start, start + n)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnt,thd->nhd", probs, v)


def _meta(prefill: bool, tables: list[list[int]], starts: list[int], ns: list[int]) -> AttentionMetadata:
    return paged_meta(prefill, tables, starts, ns, BS)


def test_prefill_reads_cached_prefix_and_decode_is_batched() -> None:
    torch.manual_seed(0)
    backend = TorchAttentionBackend()
    kv = LayerKV(torch.zeros(12, BS, HKV, D), torch.zeros(12, BS, HKV, D))
    lens = [7, 10]
    tables = [[5, 2], [9, 0, 11]]
    full_k = [torch.randn(n + 1, HKV, D) for n in lens]
    full_v = [torch.randn(n + 1, HKV, D) for n in lens]
    full_q = [torch.randn(n + 1, HQ, D) for n in lens]
    # seq 0: prefill all 7 tokens; seq 1: 4 "cached" tokens written beforehand, prefill the other 6
    backend.write_kv(full_k[1][:4], full_v[1][:4], kv, _meta(True, [tables[1]], [0], [4]))
    starts, ns = [0, 4], [7, 6]
    meta = _meta(True, tables, starts, ns)
    q = torch.cat([full_q[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns, strict=True))])
    k = torch.cat([full_k[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns, strict=True))])
    v = torch.cat([full_v[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns, strict=True))])
    out = backend.forward(q, k, v, kv, meta, 1 / math.sqrt(D))
    ref0 = _reference(full_q[0][:7], full_k[0][:7], full_v[0][:7], 0)
    ref1 = _reference(full_q[1][4:10], full_k[1][:10], full_v[1][:10], 4)
    assert torch.allclose(out, torch.cat([ref0, ref1]), atol=1e-5)
    # one decode step for both sequences (seq 1's block table is wider: padding must be masked)
    meta = _meta(False, tables, lens, [1, 1])
    q = torch.stack([full_q[i][n] for i, n in enumerate(lens)])
    k = torch.stack([full_k[i][n] for i, n in enumerate(lens)])
    v = torch.stack([full_v[i][n] for i, n in enumerate(lens)])
    out = backend.forward(q, k, v, kv, meta, 1 / math.sqrt(D))
    for i, n in enumerate(lens):
        ref = _reference(full_q[i][n : n + 1], full_k[i][: n + 1], full_v[i][: n + 1], n)
        assert torch.allclose(out[i], ref[0], atol=1e-5)
