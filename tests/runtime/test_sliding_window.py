"""Sliding-window attention in the runtime: the query at position i sees keys i - window < j <= i (transformers'
rule), in prefill (fresh, after a cached prefix) and decode over the paged cache, with and without tanh soft-capping
(checked against transformers' Gemma 2 eager attention). Mistral and Phi-3 window every layer when config.json
gives ``sliding_window``: served past the window, logits within 1e-5 of transformers and greedy tokens equal to
``generate``. Qwen's opt-in window (only the layers from max_window_layers on) stays refused above the window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runtime import engine_logits, greedy, hf_logits, paged_meta, save_hf, tiny_qwen
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from quantkit.errors import QuantkitError
from quantkit.runtime.attention_backend import AttentionMetadata, TorchAttentionBackend
from quantkit.runtime.engine import Engine
from quantkit.runtime.kv_cache import LayerKV
from quantkit.runtime.llm import LLM

BS, HQ, HKV, D = 4, 4, 2, 16
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 71, 9, 200]
FAMILIES = ("mistral", "phi3")
_CONFIG = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, initializer_range=0.1,
)  # fmt: skip


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None, softcap: float | None):
    """transformers' eager attention (Gemma 2's, which soft-caps) of queries at positions ``start..`` over keys
    ``0..``, under its sliding-window causal mask; ``q [n, Hq, D]``, ``k``/``v [ctx, Hkv, D]``."""
    n, ctx = q.shape[0], k.shape[0]
    i = torch.arange(start, start + n)[:, None]
    j = torch.arange(ctx)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    mask = torch.zeros(n, ctx).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim = HQ // HKV, D
    out, _ = eager_attention_forward(
        module, *(t.transpose(0, 1)[None] for t in (q, k, v)), mask, scaling=D**-0.5, softcap=softcap
    )
    return out[0]  # [n, Hq, D]


def _meta(prefill: bool, tables: list[list[int]], starts: list[int], ns: list[int]) -> AttentionMetadata:
    return paged_meta(prefill, tables, starts, ns, BS)


@pytest.mark.parametrize(("window", "softcap"), [(4, None), (4, 1.5), (None, 1.5), (64, None)])
def test_torch_backend_matches_transformers_eager_attention(window: int | None, softcap: float | None) -> None:
    """Sequence 0 prefills 11 tokens at once, sequence 1 prefills 6 after 4 cached ones; then both decode, and
    decode again past the window: each output equals transformers' masked (and capped) eager attention."""
    gen = torch.Generator().manual_seed(0)
    backend = TorchAttentionBackend()
    kv = LayerKV(torch.zeros(16, BS, HKV, D), torch.zeros(16, BS, HKV, D))
    tables = [[5, 2, 7, 12], [9, 0, 11, 3]]
    q, k, v = (torch.randn(2, 14, h, D, generator=gen) * 2 for h in (HQ, HKV, HKV))  # scores large enough to cap
    backend.write_kv(k[1, :4], v[1, :4], kv, _meta(True, [tables[1]], [0], [4]))  # the cached prefix
    starts, ns = [0, 4], [11, 6]
    rows = [slice(s, s + n) for s, n in zip(starts, ns, strict=True)]
    out = backend.forward(
        *(torch.cat([t[b, r] for b, r in enumerate(rows)]) for t in (q, k, v)),
        kv,
        _meta(True, tables, starts, ns),
        D**-0.5,
        window=window,
        softcap=softcap,
    )
    want = torch.cat(
        [_eager(q[b, r], k[b, : r.stop], v[b, : r.stop], r.start, window, softcap) for b, r in enumerate(rows)]
    )
    assert (out - want).abs().max() < 1e-5
    for lens in ([11, 10], [12, 11], [13, 12]):  # decode steps, the windows sliding with them
        step = [torch.stack([t[b, n] for b, n in enumerate(lens)]) for t in (q, k, v)]
        out = backend.forward(*step, kv, _meta(False, tables, lens, [1, 1]), D**-0.5, window=window, softcap=softcap)
        for b, n in enumerate(lens):
            want = _eager(q[b, n : n + 1], k[b, : n + 1], v[b, : n + 1], n, window, softcap)
            assert (out[b] - want[0]).abs().max() < 1e-5, (lens, b)


def tiny(family: str, **overrides) -> PreTrainedModel:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **{**_CONFIG, **overrides})
    return AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    root = tmp_path_factory.mktemp("windowed")
    return {f: (model := tiny(f, sliding_window=5), save_hf(model, root / f)) for f in FAMILIES}


def _generate(model: PreTrainedModel, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_windowed_matches_transformers_past_the_window(family: str, windowed) -> None:
    model, path = windowed[family]
    engine = Engine(path, num_kv_blocks=64, block_size=4, max_model_len=128)  # refused before: 128 > the window
    assert [layer.self_attn.window for layer in engine.model.model.layers] == [5, 5]
    error = (engine_logits(engine, PROMPT) - hf_logits(model, PROMPT)).abs().max().item()
    assert error < 1e-5, f"{family}: max logit error {error:.2e}"
    windowless = tiny(family)
    assert (hf_logits(windowless, PROMPT) - hf_logits(model, PROMPT)).abs().max() > 1e-3  # the window bites
    prompt = PROMPT[:3]
    expected = _generate(model, prompt, 20)
    assert expected != _generate(windowless, prompt, 20)
    (out,) = LLM(path, num_kv_blocks=64, block_size=4, max_model_len=128).generate(prompt, greedy(20))
    assert out.token_ids == expected


def test_qwens_opt_in_window_stays_refused_above_it(tmp_path: Path) -> None:
    """transformers windows only Qwen's layers from max_window_layers on, which the runtime does not implement."""
    model = tiny_qwen("qwen2")
    model.config.use_sliding_window, model.config.sliding_window = True, 8
    path = save_hf(model, tmp_path / "qwen2")
    with pytest.raises(QuantkitError, match=r"max_window_layers.*max_model_len <= 8"):
        Engine(path, num_kv_blocks=16, block_size=4, max_model_len=32)
    engine = Engine(path, num_kv_blocks=16, block_size=4, max_model_len=8)
    assert all(layer.self_attn.window is None for layer in engine.model.model.layers)
