"""Fair shares of the running batch between tenants (API keys), on the scheduler test's fake model: a tenant that
filled the batch while nobody else waited yields as others arrive; one tenant alone is never preempted for it."""

from __future__ import annotations

from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import Sequence
from runtime.test_scheduler import check_outputs, make, req, run_all, step


def test_a_tenant_that_filled_the_batch_yields_to_tenants_that_arrive() -> None:
    """Issue #39: one API key's requests took every free slot while nobody else waited; when other keys' requests
    arrive, its newest running sequences yield (preempted back into its own queue) until no tenant runs more than one
    sequence more than another, and every request still ends with the reference tokens."""
    sched, model = make(max_num_seqs=4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    flood = [Sequence(req(5 + i).token_ids, params, tenant="a") for i in range(4)]
    for seq in flood:
        sched.add(seq)
    step(sched, model)
    step(sched, model)
    others = [Sequence(req(4 + i, 6).token_ids, SamplingParams(max_tokens=6), tenant=t) for i, t in enumerate("bcd")]
    for seq in others:
        sched.add(seq)
    out, _ = step(sched, model)
    assert out.is_prefill and out.seqs == others
    assert out.preempted == [flood[3], flood[2], flood[1]]  # a's newest first
    assert sorted(s.tenant for s in sched.running) == ["a", "b", "c", "d"]
    finished, _ = run_all(sched, model)
    check_outputs(sched, [*flood, *others])
    assert set(finished) | {s for s in flood + others if s.is_finished} == set(flood + others)


def test_one_tenant_is_never_preempted_for_fairness() -> None:
    sched, model = make(max_num_seqs=2)
    seqs = [req(5 + i, 6) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    _, preemptions = run_all(sched, model)
    assert preemptions == 0
    check_outputs(sched, seqs)
