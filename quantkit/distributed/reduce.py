"""Sums of per-mini-batch statistics in one fixed order, whatever the number of processes.

Floating-point addition is not associative, so a Hessian summed batch after batch on one process and summed as two
halves on two processes differ in their last bits, and so would their GPTQ codes. Here the order is fixed by the
mini-batches alone: consecutive batches form *chunks* of :data:`CHUNK_BATCHES`, each summed batch after batch into
one buffer (exactly as one process always summed them), and the chunks' sums are added in a fixed binary tree over
the chunk indices ``0 .. chunks-1``: a node is ``left + right`` with ``left`` the largest power of two of its
chunks (``split``). A process runs whole chunks, a contiguous range ``[first, stop)`` of them; it sums the largest
whole subtrees inside its range (its *cover*, :func:`cover`) as its chunks complete (:class:`BatchTree`), and the
covers of all processes, side by side in chunk order, are combined by the same rule (:func:`combine`); one process
is the case where its cover is the root. Every addition is then the same on 1, 2 or N processes, so the sum is bit
for bit the same.

Why chunks and not single batches: a run of at most :data:`CHUNK_BATCHES` batches is one chunk, summed exactly as
before this module existed (the same bytes, one buffer); above that, one process holds its running chunk and at
most ``log2(chunks)`` finished partial sums (a tree over single batches would hold ``log2(batches)``: at K = 8192,
268 MB each). The price: at most one process per chunk (128 windows in batches of 4 make 8 chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Node = tuple[int, int]  # [lo, hi): the chunks a partial sum covers
CHUNK_BATCHES = 4  # consecutive mini-batches summed one after the other; part of the arithmetic: never per run


def chunks_of(batches: int) -> int:
    """How many chunks ``batches`` mini-batches make."""
    return -(-batches // CHUNK_BATCHES)


def split(lo: int, hi: int) -> int:
    """Where node ``[lo, hi)`` (two chunks or more) divides: its left child holds the largest power of two below
    its size."""
    n = hi - lo
    assert n >= 2, "a leaf does not split"
    return lo + (1 << ((n - 1).bit_length() - 1))


def is_node(lo: int, hi: int, total: int) -> bool:
    """Whether ``[lo, hi)`` is a node of the tree over ``total`` chunks."""
    a, b = 0, total
    while (a, b) != (lo, hi):
        if b - a < 2 or not a <= lo < hi <= b:
            return False
        mid = split(a, b)
        if hi <= mid:
            b = mid
        elif lo >= mid:
            a = mid
        else:
            return False
    return True


def cover(first: int, stop: int, total: int) -> list[Node]:
    """The largest nodes inside ``[first, stop)``, in chunk order: what a process running those chunks sums."""
    out: list[Node] = []

    def visit(lo: int, hi: int) -> None:
        if stop <= lo or hi <= first:
            return
        if first <= lo and hi <= stop:
            out.append((lo, hi))
            return
        mid = split(lo, hi)
        visit(lo, mid)
        visit(mid, hi)

    if first < stop:
        visit(0, total)
    return out


@dataclass(slots=True)
class _Partial:
    node: Node
    value: torch.Tensor


class BatchTree:
    """Partial sums of the chunks ``[first, stop)`` of a tree over ``total`` chunks, pushed in chunk order.

    A pushed chunk is merged with its left sibling as soon as the sibling is complete (in place, into the left
    one), so what is left after the last chunk is :func:`cover` ``(first, stop, total)``.
    """

    def __init__(self, total: int, first: int = 0, stop: int | None = None) -> None:
        self.total, self.first = total, first
        self.stop = total if stop is None else stop
        assert 0 <= self.first <= self.stop <= total
        self._next = first
        self._stack: list[_Partial] = []

    def push(self, value: torch.Tensor) -> None:
        """Add the next chunk's sum (the tree takes ownership: it may be summed into in place)."""
        assert self._next < self.stop, f"chunk {self._next} is outside [{self.first}, {self.stop})"
        self._stack.append(_Partial((self._next, self._next + 1), value))
        self._next += 1
        _merge(self._stack, self.first, self.stop, self.total)

    @property
    def complete(self) -> bool:
        return self._next == self.stop

    def nodes(self) -> list[tuple[Node, torch.Tensor]]:
        """This range's partial sums, in chunk order (its cover, once every chunk is pushed)."""
        assert self.complete, f"chunks {self._next}..{self.stop - 1} were never pushed"
        return [(p.node, p.value) for p in self._stack]


def combine(parts: Sequence[tuple[Node, torch.Tensor]], total: int) -> torch.Tensor:
    """The sum of every chunk from the covers of all processes side by side (in chunk order), merged in the
    tree's order; the first part's tensor is summed into in place."""
    stack: list[_Partial] = []
    expected = 0
    for node, value in parts:
        assert node[0] == expected, f"partial sums must be in chunk order without gaps (got {node} at {expected})"
        expected = node[1]
        stack.append(_Partial(node, value))
        _merge(stack, 0, total, total)
    assert expected == total and len(stack) == 1, f"the parts cover chunks 0..{expected - 1} of {total}"
    return stack[0].value


def _merge(stack: list[_Partial], first: int, stop: int, total: int) -> None:
    """Merge the top two partial sums while they are the two children of a node inside ``[first, stop)``."""
    while len(stack) >= 2:
        left, right = stack[-2], stack[-1]
        lo, mid, hi = left.node[0], left.node[1], right.node[1]
        if right.node[0] != mid or lo < first or hi > stop or not is_node(lo, hi, total) or split(lo, hi) != mid:
            return
        left.value.add_(right.value)  # the one addition of this node, the same on every process count
        left.node = (lo, hi)
        stack.pop()


def chunk_ranges(total: int, world: int) -> list[tuple[int, int]]:
    """Contiguous, balanced chunk ranges ``[first, stop)`` of each rank (the later ranks get one more)."""
    return [(r * total // world, (r + 1) * total // world) for r in range(world)]


def batch_range(chunks: tuple[int, int], batches: int) -> tuple[int, int]:
    """The mini-batches ``[first, stop)`` of a chunk range, of ``batches`` in all."""
    return chunks[0] * CHUNK_BATCHES, min(chunks[1] * CHUNK_BATCHES, batches)
