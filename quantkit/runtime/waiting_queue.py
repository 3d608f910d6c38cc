"""The scheduler's waiting queue: preempted sequences first, then new ones shared fairly between tenants.

* Preempted sequences (sent back by a decode step that ran out of blocks) come first, in the order they were sent
  back: they already had their turn and hold generated tokens, as in nano-vllm and vLLM.
* New sequences wait per tenant (the API key that sent them; one tenant when the server has no keys or one), each
  tenant's in order of ``(priority, arrival)``: lower priority first, ties by arrival (vLLM's ``priority``).
* Between tenants, the next admission goes to the tenant with the fewest running sequences (counting those admitted
  in this step), ties to the tenant whose next sequence has the lower ``(priority, arrival)``. A tenant with one
  waiting request and nothing running is therefore admitted before any further request of a tenant that already
  runs one, whatever that tenant has queued: a flood of 256 queued requests delays another tenant's single request
  by at most one admission. Priority orders a tenant's own requests; it cannot buy one tenant a larger share than
  another's.

With one tenant this is exactly a queue ordered by ``(priority, arrival)``: FIFO when every priority is 0.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping

from quantkit.runtime.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._preempted: deque[Sequence] = deque()
        self._tenants: dict[str, list[tuple[int, int, int, Sequence]]] = {}  # tenant -> heap of (prio, arrival, id)

    def __len__(self) -> int:
        return len(self._preempted) + sum(len(heap) for heap in self._tenants.values())

    def __bool__(self) -> bool:
        return bool(self._preempted) or bool(self._tenants)

    def __iter__(self) -> Iterator[Sequence]:
        """Preempted sequences, then every tenant's in ``(priority, arrival)`` order (not the admission order)."""
        yield from self._preempted
        yield from (entry[-1] for entry in sorted(e for heap in self._tenants.values() for e in heap))

    def push(self, seq: Sequence) -> None:
        """A new sequence (its ``arrival`` stamped)."""
        heap = self._tenants.setdefault(seq.tenant, [])
        heapq.heappush(heap, (seq.priority, seq.arrival, seq.seq_id, seq))

    def push_preempted(self, seq: Sequence) -> None:
        """A preempted sequence: in front of every new one; later victims of one step were pushed first."""
        self._preempted.appendleft(seq)

    def peek(self, running: Mapping[str, int]) -> Sequence | None:
        """The sequence to admit next, given each tenant's running sequences (see the module docstring)."""
        if self._preempted:
            return self._preempted[0]
        best: tuple[int, int, int, int] | None = None
        chosen: Sequence | None = None
        for tenant, heap in self._tenants.items():
            priority, arrival, seq_id, seq = heap[0]
            key = (running.get(tenant, 0), priority, arrival, seq_id)
            if best is None or key < best:
                best, chosen = key, seq
        return chosen

    def pop(self, seq: Sequence) -> None:
        """Remove ``seq``, which :meth:`peek` just returned."""
        if self._preempted and self._preempted[0] is seq:
            self._preempted.popleft()
            return
        heap = self._tenants[seq.tenant]
        assert heap[0][-1] is seq, "pop() takes the sequence peek() returned"
        heapq.heappop(heap)
        if not heap:
            del self._tenants[seq.tenant]

    def remove(self, seq: Sequence) -> None:
        """Remove a waiting sequence from anywhere (aborted or finished while waiting)."""
        if seq in self._preempted:
            self._preempted.remove(seq)
            return
        heap = self._tenants[seq.tenant]
        heap[:] = [entry for entry in heap if entry[-1] is not seq]
        heapq.heapify(heap)
        if not heap:
            del self._tenants[seq.tenant]
