"""Which rank solves which of a stage's solves: longest processing time first over the ranks.

A stage's solves (a group of linears that share a scheme, or a chunk of mixture-of-experts experts) are independent
given the stage's Hessian, so they can run on different ranks at once and their results be broadcast. A solve's
cost is taken as its columns times its rows (GPTQ sweeps every column over every row; round-to-nearest reads every
weight once). The assignment is greedy: solves by falling cost (ties in their own order), each to the least loaded
rank (ties to the lowest rank), which is within 4/3 of the best makespan. It depends on the costs and the number of
ranks alone, so every rank computes the same plan without talking.
"""

from __future__ import annotations

from collections.abc import Sequence


def assign(costs: Sequence[int], world: int) -> list[int]:
    """The rank of each solve (in the order of ``costs``)."""
    if world < 1:
        raise ValueError(f"world size must be positive, got {world}")
    loads = [0] * world
    owner = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner[index] = rank
        loads[rank] += costs[index]
    return owner


def makespan(costs: Sequence[int], owners: Sequence[int], world: int) -> int:
    """The largest load of a rank under ``owners`` (what the stage waits for)."""
    loads = [0] * world
    for cost, rank in zip(costs, owners, strict=True):
        loads[rank] += cost
    return max(loads, default=0)
