"""The runtime on the real SmolLM2-135M: greedy tokens equal Hugging Face ``generate`` (fp32), batched or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.runtime.llm import LLM
from quantkit.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32
PROMPTS = [
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who",
    "The three most important inventions of the twentieth century are",
    "Anne Elliot had been forced into prudence in her youth, she learned romance as she grew older:",
]


@pytest.fixture(scope="module")
def hf_reference(smollm2_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy completion ids) from HF generate, one prompt at a time (no padding), fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts, completions = [], []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            prompts.append(ids[0].tolist())
            completions.append(out[0, ids.shape[1] :].tolist())
    assert all(len(c) == NEW_TOKENS for c in completions)  # no prompt stops early at EOS
    return prompts, completions


def test_greedy_matches_hf_generate(smollm2_dir: Path, hf_reference) -> None:
    prompt_ids, expected = hf_reference
    llm = LLM(smollm2_dir, kv_cache_memory=64 * 1024**2)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))  # all in one batch
    assert [o.prompt_token_ids for o in outs] == prompt_ids
    for out, ref in zip(outs, expected, strict=True):
        assert out.token_ids == ref
        assert out.text == llm.tokenizer.decode(ref, skip_special_tokens=True)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_staggered_chunked_preempted_prefix_cached_matches_hf(smollm2_dir: Path, hf_reference) -> None:
    """Requests arriving at different steps, chunked prefill, a cache too small for all, shared prefixes."""
    prompt_ids, expected = hf_reference
    llm = LLM(smollm2_dir, num_kv_blocks=14, block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    order = [*range(len(PROMPTS)), 2]  # prompt 2 twice: the second copy reads its prefix from the cache
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    step = 0
    while len(results) < len(order):
        if step % 3 == 0 and step // 3 < len(order):
            ids[engine.add_request(prompt_ids[order[step // 3]], params)] = step // 3
        results.update({ids[o.request_id]: o.token_ids for o in engine.step() if o.finished})
        step += 1
    assert [results[i] for i in range(len(order))] == [expected[i] for i in order]
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
