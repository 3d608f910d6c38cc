"""Sliding windows on the Triton decode path (interpreter on CPU): an 8-bit cache read within the window, and a
Gemma 3 engine on the Triton backend (its KV-write and paged-attention kernels, the norms flagged for the kernel as
on CUDA, which Gemma's (1 + weight) norms ignore) giving transformers' greedy tokens past the window."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)
from helpers.gemma import PROMPT, generate, tiny_gemma3
from helpers.runtime import greedy
from helpers.tiny import build_word_tokenizer

from quantkit.runtime import model as runtime_model
from quantkit.runtime.kernels.kv_cache_write import kv_cache_write
from quantkit.runtime.kernels.paged_attention import paged_attention, paged_attention_reference
from quantkit.runtime.layers import OffsetRMSNorm, RMSNorm
from quantkit.runtime.llm import LLM


def test_windowed_decode_over_an_8bit_cache(device):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d = 12, 4, 2, 16
    lens = [9, 23]
    tables = torch.tensor([[3, 7, 1, 0, 0, 0], [2, 5, 8, 9, 10, 11]], dtype=torch.int32, device=device)
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=torch.int8, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, block_size, hkv, dtype=torch.float16, device=device)
    v_scale = torch.zeros_like(k_scale)
    pages = [
        int(tables[b, p // block_size]) * block_size + p % block_size for b, n in enumerate(lens) for p in range(n)
    ]
    slots = torch.tensor(pages, device=device)
    k = torch.randn(len(pages), hkv, d, generator=gen).to(device)
    v = torch.randn(len(pages), hkv, d, generator=gen).to(device)
    kv_cache_write(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(2, 4, d, generator=gen).to(device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    k_deq = (k_cache.float() * k_scale.float()[..., None]).contiguous()
    v_deq = (v_cache.float() * v_scale.float()[..., None]).contiguous()
    ref = paged_attention_reference(q, k_deq, v_deq, tables, ctx, 0.25, window=6)
    out = paged_attention(q, k_cache, v_cache, tables, ctx, 0.25, k_scale=k_scale, v_scale=v_scale, window=6)
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5


@pytest.mark.slow
def test_gemma3_engine_on_the_triton_backend_matches_generate(device, tmp_path, monkeypatch):
    model = tiny_gemma3(tie_word_embeddings=False)  # an untied head: tokens that vary (see test_gemma3.py)
    model.save_pretrained(tmp_path)
    build_word_tokenizer().save_pretrained(tmp_path)
    original = runtime_model.CausalLM.prepare

    def prepare_as_on_cuda(self, dtype, use_kernels, max_positions):
        original(self, dtype, True, max_positions)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.use_kernel = True

    monkeypatch.setattr(runtime_model.CausalLM, "prepare", prepare_as_on_cuda)
    options = {"num_kv_blocks": 64, "block_size": 4, "max_model_len": 128, "dtype": "float32", "device": device}
    llm = LLM(tmp_path, backend="triton", **options)
    assert llm.engine.runner.backend.name == "triton"
    assert all(isinstance(m, OffsetRMSNorm) for m in llm.engine.model.modules() if isinstance(m, RMSNorm))
    prompts = [PROMPT[:3], PROMPT]  # decode from inside the window past it; a prompt longer than the window
    outs = llm.generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == [generate(model, p, 16) for p in prompts]
