"""Scheduler: admission, batching limits, preemption, chunked prefill, abort; driven by a fake model.

The fake model reads its context back from a fake KV cache (token ids stored per block slot), so a
bookkeeping bug (a block reused while still cached, a wrong prefix hit, a lost generated token after
preemption) changes its output; every finished request is compared with a plain reference decode.
"""

from __future__ import annotations

import random

import pytest

from quantkit.errors import QuantkitError
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from quantkit.runtime.sequence import FinishReason, Sequence, SequenceStatus

BS = 4
VOCAB = 23
EOS = 0


def next_token(context: list[int]) -> int:
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], params: SamplingParams, eos: int | None, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while True:
        t = next_token(tokens)
        tokens.append(t)
        n = len(tokens) - len(prompt)
        if (t == eos and not params.ignore_eos) or t in params.stop_token_ids:
            break
        if n >= params.max_tokens or len(tokens) >= max_model_len:
            break
    return tokens[len(prompt) :]


class FakeModel:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.slots: dict[tuple[int, int], int] = {}

    def step(self, out: SchedulerOutput) -> list[int]:
        bs, cfg = self.bm.block_size, self.sched.config
        assert len(out.seqs) == len(out.num_tokens) == len({s.seq_id for s in out.seqs})
        assert len(out.seqs) <= cfg.max_num_seqs and out.num_batched_tokens <= cfg.max_num_batched_tokens
        sampled = []
        for seq, n in zip(out.seqs, out.num_tokens, strict=True):
            start = seq.num_computed_tokens
            assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_tokens - start
            if not out.is_prefill:
                assert n == 1 and start == seq.num_tokens - 1
            assert len(seq.block_table) == seq.num_blocks(bs)
            for p in range(start, start + n):
                block_id = seq.block_table[p // bs]
                assert self.bm.ref_count(block_id) == 1, "wrote into a shared block"
                self.slots[(block_id, p % bs)] = seq.token_ids[p]
            context = [self.slots.get((seq.block_table[p // bs], p % bs)) for p in range(start + n)]
            assert context == seq.token_ids[: start + n], "KV read back differs"
            sampled.append(next_token(context) if start + n == seq.num_tokens else -1)
        return sampled


def make(
    num_blocks: int = 64,
    eos: int | None = EOS,
    prefix_caching: bool = True,
    **cfg: int | bool,
) -> tuple[Scheduler, FakeModel]:
    sched = Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, BS, prefix_caching), eos)
    return sched, FakeModel(sched)


def step(sched: Scheduler, model: FakeModel) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    finished = sched.postprocess(out.seqs, model.step(out))
    live = list(sched.running) + list(sched.waiting)
    sched.block_manager.check_invariants(live)
    assert sched.num_running <= sched.config.max_num_seqs
    assert all(not s.block_table for s in sched.waiting)
    return out, finished


def run_all(sched: Scheduler, model: FakeModel, max_steps: int = 20_000) -> tuple[list[Sequence], int]:
    finished: list[Sequence] = []
    preemptions = 0
    for _ in range(max_steps):
        if sched.is_finished():
            return finished, preemptions
        out, done = step(sched, model)
        assert not out.is_empty, "scheduler made no progress"
        finished += done
        preemptions += len(out.preempted)
    raise AssertionError("requests starved")


def check_outputs(sched: Scheduler, seqs: list[Sequence]) -> None:
    eos = next(iter(sched.eos_token_ids), None)
    for seq in seqs:
        assert seq.is_finished and not seq.block_table
        want = reference(seq.prompt_token_ids, seq.sampling_params, eos, sched.config.max_model_len)
        assert seq.completion_token_ids == want, seq.seq_id


def req(prompt: list[int] | int, max_tokens: int = 8, **kw: object) -> Sequence:
    tokens = prompt if isinstance(prompt, list) else [1 + (i * 5) % (VOCAB - 1) for i in range(prompt)]
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens, **kw))


def test_prefill_is_fifo_then_decode() -> None:
    sched, model = make()
    seqs = [req([i + 1] * (3 + i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched, model)
    assert out.is_prefill and out.seqs == seqs and out.num_tokens == [3, 4, 5]
    out, _ = step(sched, model)
    assert not out.is_prefill and out.seqs == seqs and out.num_tokens == [1, 1, 1]
    later = req([9, 9])
    sched.add(later)
    out, _ = step(sched, model)
    assert out.is_prefill and out.seqs == [later]  # a new arrival is prefilled before the next decode


def test_max_num_seqs_bounds_running_batch() -> None:
    sched, model = make(max_num_seqs=2)
    seqs = [req([i + 1, 2, 3], max_tokens=3, ignore_eos=True) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched, model)
    assert out.seqs == seqs[:2] and sched.num_waiting == 3
    out, _ = step(sched, model)
    assert not out.is_prefill and out.seqs == seqs[:2]
    finished, _ = run_all(sched, model)
    assert finished == seqs  # admitted and finished in arrival order, two at a time
    check_outputs(sched, seqs)


def test_max_num_batched_tokens_bounds_prefill() -> None:
    sched, model = make(max_num_batched_tokens=32, max_model_len=32)
    seqs = [req([i + 1] * 12, max_tokens=4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched, model)
    assert out.seqs == seqs[:2] and out.num_batched_tokens == 24  # a third would need 36
    out, _ = step(sched, model)
    assert out.is_prefill and out.seqs == seqs[2:4]  # strict FIFO: the head goes first
    run_all(sched, model)
    check_outputs(sched, seqs)


def test_preemption_sends_newest_to_front_of_waiting_and_it_completes() -> None:
    sched, model = make(num_blocks=6, max_num_seqs=2, eos=None)
    a, b, c = (req([k] * 8, max_tokens=12) for k in (3, 5, 7))
    for s in (a, b, c):
        sched.add(s)
    while True:
        out, _ = step(sched, model)
        if out.preempted:
            break
    assert out.preempted == [b] and out.seqs == [a]
    assert list(sched.waiting) == [b, c]  # in front of the request that never ran
    assert b.status is SequenceStatus.WAITING and not b.block_table and b.num_computed_tokens == 0
    assert b.num_completion_tokens == 5  # generated tokens are kept for the recompute
    kept = b.completion_token_ids
    finished, _ = run_all(sched, model)
    assert finished[0] is a and set(finished) == {a, b, c}
    assert b.completion_token_ids[:5] == kept and b.num_completion_tokens == 12
    check_outputs(sched, [a, b, c])


def test_sequence_preempts_itself_when_it_is_the_newest() -> None:
    sched, model = make(num_blocks=5, eos=None)
    a, b = req([3] * 8, max_tokens=6), req([5] * 7, max_tokens=6)
    sched.add(a)
    sched.add(b)
    step(sched, model)  # prefill: 2 + 2 blocks
    out, _ = step(sched, model)  # a takes the last free block
    assert out.seqs == [a, b] and sched.block_manager.num_free_blocks == 0
    out, _ = step(sched, model)  # b needs a block, nobody newer to evict
    assert out.preempted == [b] and out.seqs == [a] and list(sched.waiting) == [b]
    run_all(sched, model)
    check_outputs(sched, [a, b])


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_simulation_every_request_finishes_correctly(chunked: bool, prefix_caching: bool) -> None:
    total_preemptions = 0
    for seed in range(12):
        rng = random.Random(seed)
        sched, model = make(
            num_blocks=14,
            prefix_caching=prefix_caching,
            max_num_seqs=6,
            max_num_batched_tokens=24 if chunked else 48,
            max_model_len=48,
            enable_chunked_prefill=chunked,
        )
        shared = [rng.randrange(1, VOCAB) for _ in range(20)]
        seqs: list[Sequence] = []
        finished: list[Sequence] = []
        for i in range(40):
            prompt = shared[: rng.randint(0, 20)] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))]
            seq = req(prompt, max_tokens=rng.randint(1, 48 - len(prompt)), ignore_eos=i % 3 == 0)
            sched.add(seq)
            seqs.append(seq)
            for _ in range(rng.randint(0, 3)):  # requests arrive while others run
                if not sched.is_finished():
                    out, done = step(sched, model)
                    finished += done
                    total_preemptions += len(out.preempted)
        done, preemptions = run_all(sched, model)
        finished += done
        total_preemptions += preemptions
        assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
        check_outputs(sched, seqs)
        assert sched.block_manager.num_free_blocks == 14
    assert total_preemptions > 0  # the cache was tight enough to exercise preemption


def test_chunked_prefill_splits_long_prompt_within_budget() -> None:
    sched, model = make(enable_chunked_prefill=True, max_num_batched_tokens=16, max_model_len=128)
    long = req(50, max_tokens=4)
    sched.add(long)
    chunks = []
    for _ in range(3):
        out, _ = step(sched, model)
        assert out.is_prefill and out.seqs == [long]
        chunks.append(out.num_tokens[0])
        assert long.num_completion_tokens == 0  # nothing sampled from a partial prefill
    assert chunks == [16, 16, 16] and long.num_computed_tokens == 48
    short = req([4, 4, 4], max_tokens=2)
    sched.add(short)
    out, _ = step(sched, model)  # the last chunk and the new prompt share the budget
    assert out.seqs == [long, short] and out.num_tokens == [2, 3]
    assert long.num_completion_tokens == 1 and short.num_completion_tokens == 1
    run_all(sched, model)
    check_outputs(sched, [long, short])


def test_chunked_prefill_gives_new_prompt_a_partial_chunk() -> None:
    sched, model = make(enable_chunked_prefill=True, max_num_batched_tokens=10, max_model_len=64)
    a, b = req(6, max_tokens=3), req([2] * 9, max_tokens=3)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, model)
    assert out.seqs == [a, b] and out.num_tokens == [6, 4]
    out, _ = step(sched, model)
    assert out.is_prefill and out.seqs == [b] and out.num_tokens == [5]
    run_all(sched, model)
    check_outputs(sched, [a, b])


def test_prefix_cache_reuse_through_scheduler() -> None:
    sched, model = make(eos=None)
    first = req(12, max_tokens=1)  # its prefill computes (and caches) all 3 full blocks
    sched.add(first)
    run_all(sched, model)
    same, longer = req(12, max_tokens=2), req(13, max_tokens=2)
    sched.add(same)
    sched.add(longer)
    out, _ = step(sched, model)
    # `same` is fully cached but must compute its last token: it recomputes its whole last block.
    assert out.seqs == [same, longer] and out.num_tokens == [4, 1]
    assert same.num_cached_tokens == 8 and longer.num_cached_tokens == 12
    shared = same.block_table[:2]
    assert shared == longer.block_table[:2] and [sched.block_manager.ref_count(b) for b in shared] == [2, 2]
    assert same.block_table[2] != longer.block_table[2]  # `longer` reuses first's block, `same` a fresh one
    run_all(sched, model)
    check_outputs(sched, [first, same, longer])


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    sched, model = make(num_blocks=16, max_num_seqs=2)
    a, b, c = req(9, max_tokens=20), req([3] * 9, max_tokens=20), req([4] * 5, max_tokens=3)
    for s in (a, b, c):
        sched.add(s)
    step(sched, model)
    assert sched.block_manager.num_free_blocks == 10
    assert sched.abort(c.seq_id) is c and c.finish_reason is FinishReason.ABORT  # waiting
    assert sched.abort(a.seq_id) is a and sched.block_manager.num_free_blocks == 13  # running
    out = sched.schedule()
    assert out.seqs == [b]
    sched.abort(b.seq_id)  # mid-step: postprocess skips it
    assert sched.postprocess(out.seqs, [5]) == []
    assert b.num_completion_tokens == 1 and b.is_finished
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 16
    assert sched.abort(b.seq_id) is None and sched.abort(12345) is None
    sched.block_manager.check_invariants([])


def test_request_that_can_never_fit_is_rejected_and_others_continue() -> None:
    sched, model = make(num_blocks=3, max_model_len=64)
    ok = req(10, max_tokens=3, ignore_eos=True)  # up to 12 tokens of KV: exactly the 3 blocks
    sched.add(ok)
    step(sched, model)
    with pytest.raises(QuantkitError, match=r"needs up to 4 KV blocks but the cache has only 3"):
        sched.add(req(10, max_tokens=4))
    with pytest.raises(QuantkitError, match=r"prompt \(60 tokens\) \+ max_tokens \(5\) = 65 exceeds max_model_len=64"):
        sched.add(req(60, max_tokens=5))
    with pytest.raises(QuantkitError, match="empty prompt"):
        sched.add(req([]))
    with pytest.raises(QuantkitError, match="already added"):
        sched.add(ok)
    assert sched.num_waiting == 0 and sched.num_running == 1
    finished, _ = run_all(sched, model)
    assert finished == [ok] and ok.num_completion_tokens == 3
    check_outputs(sched, [ok])


def test_stop_conditions_and_finish_hook() -> None:
    prompt = [1, 2, 3]
    free_run = reference(prompt, SamplingParams(max_tokens=40, ignore_eos=True), None, 1000)
    stop_tok = free_run[2]
    sched, model = make(eos=[free_run[1], 99], max_model_len=64)
    by_eos = req(prompt, max_tokens=40)
    ignoring = req(prompt, max_tokens=5, ignore_eos=True)
    by_stop_id = req(prompt, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok])
    by_hook = req([5, 5, 5], max_tokens=40, ignore_eos=True)
    for s in (by_eos, ignoring, by_stop_id, by_hook):
        sched.add(s)
    step(sched, model)
    sched.finish(by_hook, FinishReason.STOP)  # e.g. the engine matched a stop string
    assert by_hook.is_finished and not by_hook.block_table and sched.num_running == 3
    run_all(sched, model)
    assert by_eos.completion_token_ids == free_run[:2] and by_eos.finish_reason is FinishReason.STOP
    assert ignoring.completion_token_ids == free_run[:5] and ignoring.finish_reason is FinishReason.LENGTH
    assert by_stop_id.completion_token_ids == free_run[: free_run.index(stop_tok) + 1]
    assert by_stop_id.finish_reason is FinishReason.STOP


def test_max_model_len_finishes_with_length() -> None:
    sched, model = make(max_model_len=10, eos=None)
    seq = req(4, max_tokens=6)
    sched.add(seq)
    run_all(sched, model)
    assert seq.num_tokens == 10 and seq.finish_reason is FinishReason.LENGTH


def test_long_random_simulation_ends_with_every_block_free() -> None:
    rng = random.Random(1234)
    sched, model = make(num_blocks=20, max_num_seqs=8, max_num_batched_tokens=40, max_model_len=40)
    seqs = []
    for _ in range(300):
        seq = req([rng.randrange(1, 4) for _ in range(rng.randint(1, 10))], max_tokens=rng.randint(1, 12))
        sched.add(seq)
        seqs.append(seq)
        if rng.random() < 0.7:
            step(sched, model)
        if rng.random() < 0.03 and sched.num_running:
            sched.abort(rng.choice(list(sched.running)).seq_id)
    run_all(sched, model)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    bm.check_invariants([])
    check_outputs(sched, [s for s in seqs if s.finish_reason is not FinishReason.ABORT])


def test_schedule_twice_without_postprocess_is_an_error() -> None:
    sched, _ = make()
    sched.add(req(3))
    sched.schedule()
    with pytest.raises(RuntimeError, match="postprocess"):
        sched.schedule()


def test_config_validation() -> None:
    with pytest.raises(QuantkitError, match="max_num_seqs=0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(QuantkitError, match="enable chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048)
    SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048, enable_chunked_prefill=True)
