"""The waiting queue: FIFO for one tenant at priority 0 (the scheduler's order before #39), priority within a tenant,
fewest-running-first between tenants, preempted sequences first, removal from anywhere."""

from __future__ import annotations

from collections import Counter

from quantkit.runtime.sequence import Sequence
from quantkit.runtime.waiting_queue import WaitingQueue


def _seqs(*specs: tuple[str, int]) -> list[Sequence]:
    out = []
    for arrival, (tenant, priority) in enumerate(specs):
        seq = Sequence([1, 2], priority=priority, tenant=tenant)
        seq.arrival = arrival
        out.append(seq)
    return out


def _drain(queue: WaitingQueue, running: Counter | None = None) -> list[Sequence]:
    running = Counter() if running is None else running
    order = []
    while (seq := queue.peek(running)) is not None:
        queue.pop(seq)
        running[seq.tenant] += 1
        order.append(seq)
    return order


def test_one_tenant_is_fifo_by_priority_then_arrival() -> None:
    queue = WaitingQueue()
    seqs = _seqs(("", 0), ("", 5), ("", -1), ("", 0))
    for s in seqs:
        queue.push(s)
    assert len(queue) == 4 and _drain(queue) == [seqs[2], seqs[0], seqs[3], seqs[1]]
    assert not queue and queue.peek(Counter()) is None


def test_a_flood_delays_another_tenants_request_by_at_most_one_admission() -> None:
    queue = WaitingQueue()
    flood = _seqs(*[("a", 0)] * 256)
    for s in flood:
        queue.push(s)
    late = Sequence([1], tenant="b")
    late.arrival = 1000
    queue.push(late)
    assert _drain(queue)[:2] == [flood[0], late]  # a's first arrived first; b's one comes right after it
    queue = WaitingQueue()
    for s in [*flood, late]:
        queue.push(s)
    assert queue.peek(Counter({"a": 3})) is late  # a already runs something: b goes first
    # priority orders a tenant's own requests; it buys no share from another tenant
    urgent = _seqs(*[("a", -100)] * 3)
    queue = WaitingQueue()
    for s in [*urgent, late]:
        queue.push(s)
    assert _drain(queue)[:2] == [urgent[0], late]


def test_preempted_sequences_come_first_and_remove_works_anywhere() -> None:
    queue = WaitingQueue()
    a, b, c, d = _seqs(("x", 0), ("y", 0), ("x", 0), ("y", 0))
    for s in (a, b, c):
        queue.push(s)
    queue.push_preempted(d)
    assert list(queue) == [d, a, b, c]
    queue.remove(b)
    queue.remove(d)
    assert _drain(queue) == [a, c] and len(queue) == 0
