"""The packed W4/W8 matmul and the fused RMSNorm exactly as the engine's CUDA path calls them, here on the CPU under
the Triton interpreter: a quantized checkpoint loaded with ``use_kernels=True`` (kept packed, bfloat16 scales as
written), the norms switched to the kernel as ``CausalLM.prepare`` does on CUDA, and the matmul tiles chosen for an
H100's 132 multiprocessors (so decode takes the split-K path the GPU takes).

Tolerance: max|kernel - dense| / max|dense| <= 1e-5 (fp32), 1e-2 (fp16), 4e-2 (bf16); the dense side multiplies
the once-dequantized weight, the kernel dequantizes per tile (bf16 under the interpreter truncates, see
test_rmsnorm.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)
from helpers.runtime import engine_logits, greedy, save_quantized
from helpers.tiny import tiny_llama

from quantkit.runtime import model as runtime_model
from quantkit.runtime.engine import Engine
from quantkit.runtime.kernels import quant_matmul as qm
from quantkit.runtime.layers import Linear, RMSNorm
from quantkit.runtime.model import load_model

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}
H100_SMS = 132
ROWS = (1, 16, 37)  # a decode step at batch 1 and 16 (Triton specialises 1 and multiples of 16), a prefill


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """W4 g32 symmetric everywhere, W8 asymmetric per-channel down_proj, one 3-bit act-order v_proj (dequantized)."""
    return save_quantized(tiny_llama(seed=3), tmp_path_factory.mktemp("kernel_path") / "w4")


def as_on_cuda(model: torch.nn.Module) -> None:
    """What ``CausalLM.prepare`` turns on for CUDA besides the packed linears: the fused RMSNorm kernel."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.use_kernel = True


@pytest.fixture
def h100_tiles(monkeypatch):
    monkeypatch.setattr(qm, "_num_sms", lambda device: H100_SMS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_linears_match_their_dense_weights(device, checkpoint, dtype, h100_tiles):
    kernel = load_model(checkpoint, dtype=dtype, device=device, use_kernels=True)
    dense = dict(load_model(checkpoint, dtype=torch.float32, device=device).named_modules())
    packed = [(name, m) for name, m in kernel.named_modules() if isinstance(m, Linear) and m.use_kernel]
    bits = {m.scheme.bits for _, m in packed}
    assert bits == {4, 8} and len(packed) == 13  # 7 per layer, less the 3-bit v_proj the engine dequantizes
    assert all(m.weight_scale.dtype == torch.bfloat16 for _, m in packed)
    gen = torch.Generator().manual_seed(0)
    for name, module in packed:
        for rows in ROWS:
            x = torch.randn(rows, module.in_features, generator=gen).to(device=device, dtype=dtype)
            out = module(x)
            ref = F.linear(x.float(), dense[name].weight.float())
            assert out.dtype == dtype and out.shape == (rows, module.out_features)
            assert rel_err(out, ref) <= TOL[dtype], (name, rows, rel_err(out, ref))


def test_decode_rows_take_the_split_k_path(h100_tiles):
    """The engine's 7B decode shapes get several K splits on an H100 (the path the tests above run)."""
    for m in (1, 16):
        assert qm.default_config(m, 64, 64, 4, 32, False, torch.device("cuda")).split_k == 2  # both K blocks
        assert qm.default_config(m, 4096, 4096, 4, 128, False, torch.device("cuda")).split_k == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norms_match_the_eager_norm_as_the_decoder_calls_them(device, checkpoint, dtype):
    model = load_model(checkpoint, dtype=dtype, device=device)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 5 and not any(m.use_kernel for m in norms)  # on the CPU prepare keeps them eager
    gen = torch.Generator().manual_seed(1)
    for norm in norms:
        size = norm.weight.shape[0]
        norm.weight.data = (1 + 0.1 * torch.randn(size, generator=gen)).to(device=device, dtype=dtype)
        for rows in ROWS:
            x = (3 * torch.randn(rows, size, generator=gen)).to(device=device, dtype=dtype)
            residual = torch.randn(rows, size, generator=gen).to(device=device, dtype=dtype)
            eager = norm(x), norm(x, residual)
            norm.use_kernel = True
            fused = norm(x), norm(x, residual)
            norm.use_kernel = False
            assert rel_err(fused[0], eager[0]) <= TOL[dtype]
            assert rel_err(fused[1][0], eager[1][0]) <= TOL[dtype]
            assert rel_err(fused[1][1], eager[1][1]) <= (0 if dtype != torch.bfloat16 else 2**-7)  # x + residual


@pytest.mark.slow
def test_an_engine_on_the_cuda_kernel_path_matches_the_torch_engine(device, checkpoint, monkeypatch, h100_tiles):
    """Every kernel the CUDA engine runs (packed linears, fused norms, KV write, paged attention), float32: the
    same logits within 1e-4 and the same greedy tokens as the torch backend."""
    original = runtime_model.CausalLM.prepare

    def prepare_as_on_cuda(self, dtype, use_kernels, max_positions):
        original(self, dtype, True, max_positions)
        as_on_cuda(self)

    options = {"num_kv_blocks": 64, "block_size": 4, "max_model_len": 64, "dtype": "float32", "device": device}
    reference = Engine(checkpoint, backend="torch", **options)
    monkeypatch.setattr(runtime_model.CausalLM, "prepare", prepare_as_on_cuda)
    engine = Engine(checkpoint, backend="triton", **options)
    assert engine.runner.backend.name == "triton"
    assert sum(isinstance(m, Linear) and m.use_kernel for m in engine.model.modules()) == 13
    prompt = [1, 17, 42, 99, 7, 213, 5, 64, 31]
    assert rel_err(engine_logits(engine, prompt), engine_logits(reference, prompt)) <= 1e-4
    tokens = []
    for e in (reference, engine):
        e.add_request(prompt, greedy(8))
        e.add_request(prompt[:4], greedy(8))  # a batch of two decodes: M = 2 through every layer
        done = {}
        while e.has_unfinished():
            done |= {o.request_id: o.token_ids for o in e.step() if o.finished}
        tokens.append([done[k] for k in sorted(done)])
    assert tokens[0] == tokens[1] and all(len(t) == 8 for t in tokens[0])
