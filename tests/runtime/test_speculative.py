"""Speculative decoding on tiny random Llamas: greedy output never changes (n-gram and draft drafting, alone and
batched, with preemption, prefix caching, stop strings and aborts), speculative sampling keeps the distribution,
the KV caches end empty, and bad options are refused up front."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers.tiny import save_tiny_model

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.engine import Engine
from quantkit.runtime.llm import LLM
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.speculative.ngram import propose_ngram
from quantkit.runtime.speculative.verify import verify_greedy, verify_sampled
from runtime.test_engine import VOCAB, _assert_cache_empty, _engine, _run

SPECULATION = [
    pytest.param({"speculative": "ngram", "num_speculative_tokens": 4}, id="ngram"),
    pytest.param({"speculative": "draft", "num_speculative_tokens": 3}, id="draft"),
]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    """Another random model with the same tokenizer: its drafts are often rejected."""
    return save_tiny_model(tmp_path_factory.mktemp("draft") / "model", seed=1)


def _spec(options: dict, draft_dir: Path) -> dict:
    return {**options, "draft_model": str(draft_dir)} if options["speculative"] == "draft" else options


def _repetitive_requests(n: int, seed: int = 0, sampled: bool = False) -> list:
    """Prompts that repeat a span (so n-gram drafting has matches), greedy unless ``sampled``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        span = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 8))]
        prompt = [1, *span, *(rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 4))), *span * 2]
        if sampled:
            params = SamplingParams(temperature=0.9, top_k=20, seed=500 + i, max_tokens=rng.randint(8, 24))
        else:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 24))
        out.append((prompt[:40], params))
    return out


# ----------------------------------------------------------------- units
def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert propose_ngram(tokens, 3) == [4, 5, 6]  # the latest earlier "1 2 3" is followed by 4 5 6
    assert propose_ngram(tokens, 10) == [4, 5, 6, 1, 2, 3]  # what follows, up to the end
    assert propose_ngram([1, 2, 3, 4], 4) == []  # no earlier occurrence
    assert propose_ngram([5, 256 + 5, 5, 256 + 5, 5], 2) == [256 + 5, 5]  # multi-byte ids match whole tokens


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, token in enumerate([4, 5, 7, 8]):
        logits[row, token] = 1.0
    assert verify_greedy([4, 5, 6], logits) == [4, 5, 7]  # d3 differs: the target's token replaces it
    assert verify_greedy([4, 5, 7], logits) == [4, 5, 7, 8]  # all accepted, plus the bonus token
    assert verify_greedy([9, 5, 7], logits) == [4]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-model", "ngram"])
def test_speculative_sampling_keeps_the_target_distribution(deterministic: bool) -> None:
    """Every emitted position is distributed as the target says, whatever the draft (chi-square, fixed seeds)."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 2, 6000
    logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0)
    p = logits.softmax(-1)
    q = torch.randn(k, vocab, generator=gen).softmax(-1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        if deterministic:
            drafts, probs = [2, 3], None
        else:
            drafts, probs = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)], q
        out = verify_sampled(drafts, logits, params, gen, probs)
        first[out[0]] += 1
        if len(out) > 1 and out[0] == drafts[0]:
            second[out[1]] += 1  # the second token given an accepted first draft: distributed as p[1]
    critical = 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    assert _chi_square(first, p[0]) < critical
    assert _chi_square(second, p[1]) < critical


# ----------------------------------------------------------------- engine
@pytest.mark.parametrize("options", SPECULATION)
def test_greedy_output_is_unchanged_batched_alone_and_under_preemption(
    tiny_model_dir: Path, draft_dir: Path, options: dict
) -> None:
    requests = _repetitive_requests(10, seed=3)
    plain = _run(_engine(tiny_model_dir), requests)
    spec = _engine(tiny_model_dir, **_spec(options, draft_dir))
    assert _run(spec, requests) == plain  # batched, prefix caching on
    assert spec.spec_stats.drafted > 0 and spec.spec_stats.verify_steps > 0
    assert [_run(spec, [r])[0] for r in requests[:4]] == plain[:4]  # alone
    tight = _engine(tiny_model_dir, num_kv_blocks=24, **_spec(options, draft_dir))  # forces preemption
    assert _run(tight, requests, arrivals=[i // 3 for i in range(len(requests))]) == plain
    assert tight.num_preemptions > 0


def test_ngram_drafts_are_accepted_on_copy_heavy_output(tiny_model_dir: Path) -> None:
    requests = _repetitive_requests(6, seed=4)
    engine = _engine(tiny_model_dir, speculative="ngram", num_speculative_tokens=4)
    _run(engine, requests)
    stats = engine.spec_stats
    assert stats.accepted > 0 and stats.tokens_per_step > 1.0
    assert stats.emitted == stats.accepted + stats.verify_steps


@pytest.mark.parametrize("options", SPECULATION)
def test_stop_strings_cut_where_one_token_steps_would(tiny_model_dir: Path, draft_dir: Path, options: dict) -> None:
    prompts = ["the cat the cat the cat", "a dog and a dog and a dog and"]
    sampling = [SamplingParams(temperature=0, max_tokens=30, stop=[word]) for word in ("cat", "dog")]
    plain = LLM(tiny_model_dir, max_model_len=64).generate(prompts, sampling)
    spec = LLM(tiny_model_dir, max_model_len=64, **_spec(options, draft_dir)).generate(prompts, sampling)
    assert [(o.token_ids, o.text, o.finish_reason) for o in spec] == [
        (o.token_ids, o.text, o.finish_reason) for o in plain
    ]


@pytest.mark.parametrize("options", SPECULATION)
def test_long_random_run_with_speculation_keeps_block_invariants(
    tiny_model_dir: Path, draft_dir: Path, options: dict
) -> None:
    """Arrivals, aborts mid-speculation and preemption: the bookkeeping holds every step; both caches end empty."""
    rng = random.Random(11)
    engine = _engine(tiny_model_dir, num_kv_blocks=20, **_spec(options, draft_dir))
    requests = _repetitive_requests(24, seed=5) + _repetitive_requests(8, seed=6, sampled=True)
    pending = list(requests)
    live: list[str] = []
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            live.append(engine.add_request(*pending.pop()))
        if live and rng.random() < 0.05:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        running = engine.scheduler.running
        engine.block_manager.check_invariants(running)
        assert all(s.num_draft_tokens == 0 for s in running)
        if not pending and not engine.has_unfinished():
            break
    _assert_cache_empty(engine)
    draft = engine.speculator.draft_model
    if draft is not None:
        assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks
    assert engine.num_preemptions > 0 and engine.spec_stats.verify_steps > 0


def test_sampled_requests_keep_their_distribution_in_the_engine(tiny_model_dir: Path, draft_dir: Path) -> None:
    """The second sampled token's distribution with draft-model speculation matches decoding without it
    (two-sample chi-square over the likely tokens; the draft is another random model, often rejected)."""
    prompt = [1, 17, 42, 99, 17, 42]
    n = 600

    def second_tokens(**options) -> list[int]:
        engine = _engine(tiny_model_dir, max_num_seqs=64, **options)
        requests = [(prompt, SamplingParams(temperature=1.0, top_k=6, seed=i, max_tokens=3)) for i in range(n)]
        return [t[1] for t in _run(engine, requests)]

    plain = second_tokens()
    spec = second_tokens(speculative="draft", draft_model=str(draft_dir), num_speculative_tokens=2)
    categories = sorted(set(plain) | set(spec))
    a = torch.tensor([plain.count(c) for c in categories], dtype=torch.float64)
    b = torch.tensor([spec.count(c) for c in categories], dtype=torch.float64)
    keep = (a + b) >= 10
    a, b = a[keep], b[keep]
    pooled = (a + b) / (2 * n)
    stat = float((((a - n * pooled) ** 2 + (b - n * pooled) ** 2) / (n * pooled)).sum())
    df = len(a) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # chi-square quantile at p = 0.001
    assert df >= 3 and stat < critical, (stat, critical, a.tolist(), b.tolist())


# ----------------------------------------------------------------- bad options
@pytest.mark.parametrize("k", [0, 17, True])
def test_k_outside_1_to_16_is_refused(k) -> None:
    with pytest.raises(QuantkitError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=k)


def test_bad_speculation_options_are_refused() -> None:
    with pytest.raises(QuantkitError, match="speculative='medusa' is invalid"):
        EngineConfig(speculative="medusa")
    with pytest.raises(QuantkitError, match="needs a draft model"):
        EngineConfig(speculative="draft")
    with pytest.raises(QuantkitError, match="only with speculative='draft'"):
        EngineConfig(draft_model="x")


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = save_tiny_model(tmp_path / "other", vocab_size=VOCAB + 8)
    with pytest.raises(QuantkitError, match="vocabulary has 264 tokens and the target's 256"):
        Engine(tiny_model_dir, speculative="draft", draft_model=str(other), max_model_len=64)


def test_speculation_over_an_int8_kv_cache_keeps_greedy_output(tiny_model_dir: Path) -> None:
    requests = _repetitive_requests(6, seed=8)
    plain = _run(_engine(tiny_model_dir, kv_cache_dtype="int8"), requests)
    spec = _engine(tiny_model_dir, kv_cache_dtype="int8", speculative="ngram", num_speculative_tokens=4)
    assert _run(spec, requests) == plain and spec.spec_stats.accepted > 0
