"""Moving tensors and small objects between ranks, in orders every rank computes alike (so that no collective
waits on a partner that is not coming).

``gather_rows`` / ``scatter_rows``: the calibration rows of each rank to and from rank 0 (which keeps the work
directory); ``exchange_partials``: the per-rank partial sums of :mod:`.reduce` to the ranks that need the total;
``broadcast_object``: a solved weight from the rank that solved it to every rank; ``broadcast_tensors_`` a block's
weights from one rank; ``all_max_``: an exact elementwise maximum over ranks.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from quantkit.distributed.context import DistContext
from quantkit.distributed.reduce import Node, cover

_CPU = torch.device("cpu")


def broadcast_object(obj: Any, src: int) -> Any:
    """``obj`` from rank ``src`` on every rank (tensors inside must be on the CPU). Sent in ``torch.save``'s format:
    plain pickle, which ``broadcast_object_list`` uses, cannot load a float8 tensor back (an FP8 weight)."""
    sending = dist.get_rank() == src
    payload = None
    if sending:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = buffer.getvalue()
    box = [payload]
    dist.broadcast_object_list(box, src=src, device=_CPU)
    return obj if sending else torch.load(io.BytesIO(box[0]), weights_only=False)


def all_gather_object(obj: Any, context: DistContext) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    out: list[Any] = [None] * context.world
    dist.all_gather_object(out, obj)
    return out


def all_sum(value: int | torch.Tensor) -> torch.Tensor:
    """The integer sum over ranks (exact: int64) of ``value`` (a number or an integer tensor, on the CPU)."""
    t = torch.as_tensor(value, dtype=torch.int64).clone().cpu()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_rows(local: torch.Tensor, counts: Sequence[int], context: DistContext, dst: int = 0) -> torch.Tensor | None:
    """The rows of every rank stacked in rank order on ``dst`` (None elsewhere); rank r holds ``counts[r]`` rows."""
    local = local.contiguous()
    if context.rank != dst:
        if counts[context.rank]:  # rank ``dst`` receives nothing from a rank with no rows
            dist.send(local, dst)
        return None
    full = torch.empty((sum(counts), *local.shape[1:]), dtype=local.dtype, device=local.device)
    start = 0
    for rank, count in enumerate(counts):
        part = full[start : start + count]
        if rank == dst:
            part.copy_(local)
        elif count:
            dist.recv(part, rank)
        start += count
    return full


def scatter_rows(
    full: torch.Tensor | None, counts: Sequence[int], context: DistContext, device: torch.device, src: int = 0
) -> torch.Tensor:
    """Rank r's ``counts[r]`` rows of ``full`` (held by ``src``), on ``device``."""
    meta = broadcast_object(None if full is None else (tuple(full.shape[1:]), full.dtype), src)
    shape, dtype = meta
    start = sum(counts[: context.rank])
    if context.rank == src:
        assert full is not None
        begin = 0
        for rank, count in enumerate(counts):
            if rank != src and count:
                dist.send(full[begin : begin + count].to(device).contiguous(), rank)
            begin += count
        return full[start : start + counts[src]].to(device).clone()
    local = torch.empty((counts[context.rank], *shape), dtype=dtype, device=device)
    if counts[context.rank]:
        dist.recv(local, src)
    return local


def exchange_partials(
    own: list[tuple[Node, torch.Tensor]],
    ranges: Sequence[tuple[int, int]],
    total: int,
    holders: set[int],
    context: DistContext,
) -> list[tuple[Node, torch.Tensor]] | None:
    """Every rank's partial sums (the covers of ``ranges``), in batch order, on each rank of ``holders``; None on the
    others. Each partial goes straight from its rank to each holder."""
    assert own, f"rank {context.rank} holds no mini-batch"  # RankBlocks.plan gives every rank one at least
    like = own[0][1]
    parts: list[tuple[Node, torch.Tensor]] = []
    mine = dict(own)
    keep = context.rank in holders
    for rank, (first, stop) in enumerate(ranges):
        for node in cover(first, stop, total):
            if rank == context.rank:
                value = mine[node]
                for dst in sorted(holders - {rank}):
                    dist.send(value, dst)
            elif keep:
                value = torch.empty_like(like)
                dist.recv(value, rank)
            else:
                continue
            if keep:
                parts.append((node, value))
    return parts if keep else None


def broadcast_tensors_(tensors: Sequence[torch.Tensor], src: int) -> None:
    """Overwrite each of ``tensors`` (in the same order on every rank) with rank ``src``'s values, in place."""
    for tensor in tensors:
        dist.broadcast(tensor, src)


def all_max_(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, in place, holding the elementwise maximum over every rank's (a maximum does not depend on the
    order it is taken in: the same bits on any number of ranks)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor
