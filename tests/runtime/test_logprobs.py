"""Log-probabilities from the engine (SamplingParams.logprobs / prompt_logprobs) equal the float model's own
log-softmax, whatever the batch, the prefix cache, chunked prefill, sampling settings or speculation; requests that
do not ask get none; max_tokens 0 scores a prompt without generating."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.runtime.engine import Engine, RequestOutput
from quantkit.runtime.logprobs import token_logprobs
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import FinishReason

TOL = 1e-4
VOCAB = 256


def _engine(path: Path, **kw) -> Engine:
    opts = {"num_kv_blocks": 128, "block_size": 4, "max_model_len": 64, "max_num_batched_tokens": 64, **kw}
    return Engine(path, **opts)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1, *(rng.randrange(3, VOCAB) for _ in range(n - 1))]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of the float model's fp32 logits: row p scores token p + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    ids = [engine.add_request(p, s) for p, s in requests]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[i] for i in ids]


def _check_prompt(out: RequestOutput, ref: torch.Tensor, k: int) -> None:
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for p, score in enumerate(out.prompt_logprobs[1:], start=1):
        assert score is not None and score.token_id == ids[p]
        assert abs(score.logprob - ref[p - 1, ids[p]].item()) < TOL, p
        top = ref[p - 1].topk(k)
        assert [i for i, _ in score.top] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(score.top, top.values.tolist(), strict=True)) < TOL if k else True


def _check_completion(out: RequestOutput, hf: torch.nn.Module, k: int) -> None:
    ids = out.prompt_token_ids + out.token_ids
    ref = _reference(hf, ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
    start = len(out.prompt_token_ids)
    for j, score in enumerate(out.logprobs):
        assert score.token_id == out.token_ids[j]
        assert abs(score.logprob - ref[start + j - 1, score.token_id].item()) < TOL, j
        assert len(score.top) == k
        assert [i for i, _ in score.top] == ref[start + j - 1].topk(k).indices.tolist()


def test_prompt_logprobs_equal_the_float_models_log_softmax(tiny_model_dir: Path, hf) -> None:
    engine = _engine(tiny_model_dir)
    prompts = [_prompt(n, seed) for seed, n in enumerate((23, 9, 1, 40))]
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3)
    outs = _run(engine, [(p, params) for p in prompts])
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finished and out.finish_reason is FinishReason.LENGTH
        assert out.token_ids == [] and out.text == "" and out.logprobs is None
        _check_prompt(out, _reference(hf, prompt), 3)


def test_requests_that_do_not_ask_get_no_logprobs_and_the_same_tokens(tiny_model_dir: Path, hf) -> None:
    """Mixed in one batch with scoring requests; their completions match a run without any scoring request."""
    plain = [(_prompt(12, s), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for s in range(3)]
    scoring = [(_prompt(20, 7), SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=0))]
    alone = _run(_engine(tiny_model_dir), plain)
    mixed = _run(_engine(tiny_model_dir), [plain[0], scoring[0], *plain[1:]])
    assert [o.token_ids for o in alone] == [o.token_ids for i, o in enumerate(mixed) if i != 1]
    for out in alone:
        assert out.prompt_logprobs is None and out.logprobs is None
    _check_prompt(mixed[1], _reference(hf, mixed[1].prompt_token_ids), 0)
    _check_completion(mixed[1], hf, 2)


def test_a_cached_prefix_is_scored_anyway(tiny_model_dir: Path, hf) -> None:
    """A prompt whose blocks are in the prefix cache is still run in full when it is scored (and a later plain
    request still reads the blocks the scoring request wrote)."""
    engine = _engine(tiny_model_dir)
    prompt = _prompt(30, 3)
    first = _run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=1))])[0]
    assert first.num_cached_tokens == 0
    scored = _run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1))])[0]
    assert scored.num_cached_tokens == 0
    _check_prompt(scored, _reference(hf, prompt), 1)
    again = _run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=1))])[0]
    assert again.num_cached_tokens == 28  # 7 full blocks of 4; the last token is always computed


def test_chunked_prefill_scores_every_prompt_token_once(tiny_model_dir: Path, hf) -> None:
    engine = _engine(tiny_model_dir, enable_chunked_prefill=True, max_num_batched_tokens=8)
    prompt = _prompt(37, 5)
    out = _run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1))])[0]
    _check_prompt(out, _reference(hf, prompt), 2)
    _check_completion(out, hf, 1)


def test_generated_logprobs_are_of_the_raw_distribution_not_the_sampling_one(tiny_model_dir: Path, hf) -> None:
    """Temperature, top-k and top-p change which token is drawn, never the reported log-probability."""
    sampled = SamplingParams(temperature=1.7, top_k=20, top_p=0.8, seed=3, max_tokens=8, ignore_eos=True, logprobs=4)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=4)
    outs = _run(_engine(tiny_model_dir), [(_prompt(10, 1), sampled), (_prompt(10, 1), greedy)])
    for out in outs:
        _check_completion(out, hf, 4)
    for score in outs[1].logprobs or []:
        assert score.token_id == score.top[0][0]  # greedy picks the most likely token


def test_preemption_keeps_one_logprob_per_token(tiny_model_dir: Path, hf) -> None:
    """A KV cache too small for all requests preempts and re-prefills some: nothing is scored twice."""
    engine = _engine(tiny_model_dir, num_kv_blocks=14, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = _run(engine, [(_prompt(10, s), params) for s in range(4)])
    assert engine.num_preemptions > 0
    for out in outs:
        _check_prompt(out, _reference(hf, out.prompt_token_ids), 1)
        _check_completion(out, hf, 1)


def test_speculative_decoding_reports_the_same_logprobs(tiny_model_dir: Path, hf) -> None:
    """Several tokens accepted in one verifying pass each get the log-probability of their own position."""
    rng = random.Random(4)
    requests = []
    for _ in range(6):  # prompts that repeat a span, so n-gram drafts match (as in test_speculative)
        span = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 8))]
        prompt = [1, *span, *(rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 4))), *span * 2][:40]
        requests.append((prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)))
    plain = _run(_engine(tiny_model_dir), requests)
    engine = _engine(tiny_model_dir, speculative="ngram", num_speculative_tokens=4)
    spec = _run(engine, requests)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.spec_stats.accepted > 0
    for out in spec:
        _check_completion(out, hf, 2)


def test_a_prompt_filling_the_context_can_be_scored(tiny_model_dir: Path, hf) -> None:
    engine = _engine(tiny_model_dir)
    prompt = _prompt(64, 9)  # max_model_len
    out = _run(engine, [(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))])[0]
    _check_prompt(out, _reference(hf, prompt), 0)
    with pytest.raises(QuantkitError, match="exceeds max_model_len"):
        engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"logprobs": -1}, "logprobs=-1"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs=1.5"),
        ({"logprobs": True}, "logprobs=True"),
    ],
)
def test_invalid_logprob_settings_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises(QuantkitError, match=fragment):
        SamplingParams(**kwargs)


def test_token_logprobs_lists_top_k_per_row() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    scores = token_logprobs(logits, [0, 0], [2, 0])
    ref = logits.log_softmax(-1)
    assert scores[0].logprob == pytest.approx(ref[0, 0].item()) and scores[1].logprob == pytest.approx(ref[1, 0].item())
    assert [i for i, _ in scores[0].top] == [2, 1] and scores[1].top == ()
