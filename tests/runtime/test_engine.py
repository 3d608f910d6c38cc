"""Engine on a tiny random Llama: batching, preemption, prefix caching and chunked prefill change no output;
bad requests are refused alone; the KV cache ends empty."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from helpers.runtime import run_triton_interpreted

from quantkit.errors import QuantkitError
from quantkit.runtime.engine import Engine, RequestOutput
from quantkit.runtime.llm import LLM
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import FinishReason

VOCAB = 256


def _engine(path: Path, **kw) -> Engine:
    opts = {"num_kv_blocks": 128, "block_size": 4, "max_model_len": 64, "max_num_batched_tokens": 64, **kw}
    return Engine(path, **opts)


def _requests(n: int, seed: int = 0, shared_prefix: int = 0, sampled: bool = False) -> list:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        prompt = [1, *prefix, *(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 24)))]
        if sampled:
            params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1000 + i, max_tokens=rng.randint(4, 20))
        else:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 20))
        out.append((prompt, params))
    return out


def _run(engine: Engine, requests, arrivals: list[int] | None = None) -> list[list[int]]:
    """Add request i at step arrivals[i] (all at once by default); completion token ids in request order."""
    return [o.token_ids for o in _run_outputs(engine, requests, arrivals)]


def _run_outputs(engine: Engine, requests, arrivals: list[int] | None = None) -> list[RequestOutput]:
    arrivals = arrivals or [0] * len(requests)
    ids: dict[str, int] = {}
    results: dict[int, RequestOutput] = {}
    step = 0
    while len(results) < len(requests):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[engine.add_request(*requests[i])] = i
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out
        step += 1
        assert step < 10_000
    _assert_cache_empty(engine)
    return [results[i] for i in range(len(requests))]


def _assert_cache_empty(engine: Engine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def _solo(path: Path, requests) -> list[list[int]]:
    engine = _engine(path, enable_prefix_caching=False)
    return [_run(engine, [r])[0] for r in requests]


@pytest.fixture(scope="module")
def reqs() -> list:
    return _requests(17)


@pytest.fixture(scope="module")
def solo(tiny_model_dir: Path, reqs) -> list[list[int]]:
    return _solo(tiny_model_dir, reqs)


def test_continuous_batching_changes_nothing(tiny_model_dir: Path, reqs, solo) -> None:
    engine = _engine(tiny_model_dir, max_num_seqs=8)
    assert _run(engine, reqs, arrivals=[i // 3 for i in range(len(reqs))]) == solo


def test_preemption_under_tiny_cache(tiny_model_dir: Path, reqs, solo) -> None:
    engine = _engine(tiny_model_dir, num_kv_blocks=12)  # 48 token slots for 17 requests of up to 45 tokens
    assert _run(engine, reqs, arrivals=[i // 4 for i in range(len(reqs))]) == solo
    assert engine.num_preemptions > 0


def test_prefix_caching_on_equals_off(tiny_model_dir: Path) -> None:
    requests = _requests(10, seed=1, shared_prefix=14)  # 15 shared tokens: 3 full blocks of 4
    arrivals = [0, *range(3, 12)]  # the first request's prefix blocks are computed before the others arrive
    off = _run(_engine(tiny_model_dir, enable_prefix_caching=False), requests, arrivals)
    on = _run_outputs(_engine(tiny_model_dir, enable_prefix_caching=True), requests, arrivals)
    assert [o.token_ids for o in on] == off
    assert all(o.num_cached_tokens >= 12 for o in on[1:])


def test_chunked_prefill_changes_nothing(tiny_model_dir: Path, reqs, solo) -> None:
    engine = _engine(tiny_model_dir, enable_chunked_prefill=True, max_num_batched_tokens=8)
    assert _run(engine, reqs, arrivals=[i // 2 for i in range(len(reqs))]) == solo


def test_seeded_sampling_is_independent_of_batching(tiny_model_dir: Path) -> None:
    requests = _requests(8, seed=3, sampled=True)
    alone = _solo(tiny_model_dir, requests)
    engine = _engine(tiny_model_dir, num_kv_blocks=10, enable_chunked_prefill=True, max_num_batched_tokens=16)
    assert _run(engine, requests, arrivals=[i // 2 for i in range(8)]) == alone
    assert engine.num_preemptions > 0  # a preempted request keeps its generator and redraws nothing
    other_seeds = [(p, dataclasses.replace(s, seed=s.seed + 1)) for p, s in requests]
    assert _run(_engine(tiny_model_dir), other_seeds) != alone


def test_bad_requests_are_refused_alone(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, num_kv_blocks=8)  # 32 token slots
    good = _requests(4, seed=4)
    ids = {engine.add_request(*r): i for i, r in enumerate(good[:2])}
    bad_params = SamplingParams(max_tokens=4)
    bad_params.temperature = -1.0  # mutated after validation
    cases = [
        ([1] * 70, SamplingParams(max_tokens=4), "max_model_len"),
        ([1, 5, 6], SamplingParams(max_tokens=40), "KV blocks"),
        ([1, 5, 6], bad_params, "temperature"),
        ([1, 5, VOCAB + 3], SamplingParams(max_tokens=4), "vocabulary"),
        ([1, 5.0], SamplingParams(max_tokens=4), "integer token ids"),
        ([], SamplingParams(max_tokens=4), "empty prompt"),
    ]
    engine.step()  # the good ones are running when the bad ones arrive
    for prompt, params, message in cases:
        with pytest.raises(QuantkitError, match=message):
            engine.add_request(prompt, params)
    ids.update({engine.add_request(*r): i + 2 for i, r in enumerate(good[2:])})
    results = {}
    while engine.has_unfinished():
        results.update({ids[o.request_id]: o.token_ids for o in engine.step() if o.finished})
    assert [results[i] for i in range(4)] == _solo(tiny_model_dir, good)
    _assert_cache_empty(engine)


def test_llm_generate_reports_errors_per_request(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    outs = llm.generate(["the cat was very", "a " * 80, [1, 5, 9]], SamplingParams(temperature=0, max_tokens=6))
    assert outs[1].finish_reason is FinishReason.ERROR and "max_model_len" in (outs[1].error or "")
    assert outs[0].prompt == "the cat was very"
    assert outs[0].prompt_token_ids == llm.tokenizer("the cat was very").input_ids
    assert outs[0].finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and outs[0].token_ids
    assert outs[2].prompt_token_ids == [1, 5, 9] and outs[2].token_ids
    assert isinstance(outs[0].text, str)
    _assert_cache_empty(llm.engine)


def test_a_failed_batch_fails_its_requests_only(tiny_model_dir: Path, monkeypatch) -> None:
    engine = _engine(tiny_model_dir)
    first = engine.add_request([1, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    real_forward = engine.runner.forward

    def broken(out, inputs):
        monkeypatch.setattr(engine.runner, "forward", real_forward)  # fails once
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "forward", broken)
    (out,) = engine.step()
    assert out.request_id == first and out.finish_reason is FinishReason.ERROR and "device lost" in out.error
    _assert_cache_empty(engine)
    requests = _requests(3, seed=6)
    assert _run(engine, requests) == _solo(tiny_model_dir, requests)


def test_stop_strings_and_stop_token_ids(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    prompt = "she was not"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    words = free.text.split()
    assert len(words) >= 4
    stop_word = words[2]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_word]))[0]
    assert out.finish_reason is FinishReason.STOP and stop_word not in out.text
    assert free.text.startswith(out.text)
    stop_id = free.token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(prompt, params)[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    _assert_cache_empty(llm.engine)


def test_abort(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    a = engine.add_request([1, 5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    b = engine.add_request([1, 8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort(a) and not engine.abort(a) and not engine.abort("nope")
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [b]
    _assert_cache_empty(engine)


def test_long_random_run_leaves_cache_empty(tiny_model_dir: Path) -> None:
    rng = random.Random(5)
    engine = _engine(
        tiny_model_dir, num_kv_blocks=24, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=24
    )
    live: list[str] = []
    added = 0
    for step in range(400):
        while added < 150 and rng.random() < 0.6:
            prompt = [1, *(rng.randrange(3, 40) for _ in range(rng.randint(1, 12)))]  # small alphabet: prefix hits
            temp = rng.choice([0.0, 0.7])
            params = SamplingParams(temperature=temp, max_tokens=rng.randint(1, 10), seed=rng.choice([None, step]))
            live.append(engine.add_request(prompt, params))
            added += 1
        if live and rng.random() < 0.05:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
        engine.block_manager.check_invariants(engine.scheduler.running)
        if added >= 150 and not engine.has_unfinished():
            break
    assert added == 150 and not live
    _assert_cache_empty(engine)


_TRITON_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from quantkit.runtime.engine import Engine
from quantkit.runtime.sampling_params import SamplingParams
prompts = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
out = {}
for backend in ("torch", "triton"):
    engine = Engine(sys.argv[1], backend=backend, num_kv_blocks=32, block_size=4, max_model_len=64,
                    max_num_batched_tokens=64)
    assert type(engine.runner.backend).__name__.lower().startswith(backend)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
    res = {}
    while engine.has_unfinished():
        res.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    out[backend] = [res[i] for i in ids]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_backend_matches_torch_backend(tiny_model_dir: Path) -> None:
    """The Triton KV-write and paged decode kernels (CPU interpreter here) give the torch backend's tokens."""
    out = run_triton_interpreted(_TRITON_SCRIPT, str(tiny_model_dir))
    assert out["triton"] == out["torch"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "cuda-magic"}, "backend"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_kv_blocks": 8, "kv_cache_memory": 2**20}, "not both"),
    ],
)
def test_engine_config_is_validated(kwargs: dict, message: str) -> None:
    from quantkit.runtime.config import EngineConfig

    with pytest.raises(QuantkitError, match=message):
        EngineConfig(**kwargs)


def test_the_engine_leaves_the_allocator_policy_to_its_caller(tiny_model_dir: Path, monkeypatch) -> None:
    """The process-wide glibc policy is the entry point's choice (serve, bench, smoke; quantize sets another):
    building and running an engine calls no mallopt."""
    import quantkit.memory

    looked_up: list[str] = []
    monkeypatch.setattr(quantkit.memory, "_libc_function", lambda name: looked_up.append(name))
    llm = LLM(tiny_model_dir, num_kv_blocks=16, block_size=4, max_model_len=64)
    out = llm.generate([[1, 5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and looked_up == []


def test_a_request_that_cannot_be_sampled_fails_alone(tiny_model_dir: Path, monkeypatch) -> None:
    """Issue #39: a NaN row used to reach torch.multinomial, whose error failed every request of the step, greedy
    ones included. Now only the request whose row cannot be sampled fails; the others match their solo runs."""
    requests = [
        ([1, 5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        ([1, 8, 9], SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)),
        ([1, 10, 11, 12, 13], SamplingParams(temperature=0.7, seed=4, max_tokens=6, ignore_eos=True)),
    ]
    engine = _engine(tiny_model_dir)
    ids = [engine.add_request(*r) for r in requests]
    victim = engine.output_processor._by_id[ids[1]].seq
    forward = engine.runner.forward

    def poisoned(out, inputs):
        logits = forward(out, inputs).clone()
        if victim in out.seqs and not out.is_prefill:
            logits[out.seqs.index(victim)] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "forward", poisoned)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step() if o.finished})
    assert results[ids[1]].finish_reason is FinishReason.ERROR and "NaN" in (results[ids[1]].error or "")
    solo = _solo(tiny_model_dir, [requests[0], requests[2]])
    assert [results[ids[0]].token_ids, results[ids[2]].token_ids] == solo
    assert engine.num_failed_requests == 1 and engine.consecutive_failed_steps == 0
    _assert_cache_empty(engine)


def test_logit_bias_min_tokens_and_stop_token_ids_change_generation(tiny_model_dir: Path) -> None:
    """As OpenAI and vLLM define them: a +100 bias forces a token, -100 bans it; EOS cannot end a request before
    min_tokens; a stop token id ends it (inclusive)."""
    engine = _engine(tiny_model_dir)
    prompt = [1, 5, 6, 7]
    free = _run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])[0]
    banned = _run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias={free[0]: -100}))])[0]
    assert banned[0] != free[0]
    forced = _run(engine, [(prompt, SamplingParams(temperature=0.9, seed=1, max_tokens=5, logit_bias={9: 100}))])[0]
    assert forced == [9] * 5
    eos = 2  # the tiny model's EOS: a +100 bias ends the request at once, unless min_tokens holds it off
    assert _run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100}))])[0] == [eos]
    held = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100}, min_tokens=3)
    assert _run(engine, [(prompt, held)])[0][-1] == eos and len(_run(engine, [(prompt, held)])[0]) == 4
    stopped = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[free[2]])
    assert _run(engine, [(prompt, stopped)])[0] == free[: free.index(free[2]) + 1]
    with pytest.raises(QuantkitError, match="outside the vocabulary"):
        engine.add_request(prompt, SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(QuantkitError, match="stop_token_ids"):
        engine.add_request(prompt, SamplingParams(stop_token_ids=[VOCAB + 5]))
