"""The block loop on several processes (``torchrun``): what each rank holds and what the ranks exchange.

The calibration windows are cut at chunk boundaries (:data:`~quantkit.distributed.reduce.CHUNK_BATCHES` mini-batches)
into one contiguous share per rank, so every mini-batch holds the same windows as on one process and computes the
same bits; each stage's Hessian is summed in the fixed
order of :mod:`quantkit.distributed.reduce` and sent to the ranks that solve the stage; the stage's solves are
spread over the ranks by cost (:mod:`quantkit.distributed.plan`) and each result broadcast, so every rank goes on
with the same quantized block. Rank 0 alone keeps the work directory: it gathers every rank's rows of a block's
output to save them, and hands them out again on ``--resume`` (the float model's rows too, where the run carries
them). A transform (AWQ, SmoothQuant) runs on rank 0 on the windows it reads, gathered from every rank, and rank 0's
transformed block is broadcast; a target's sums (float targets) are added up in the Hessians' fixed order; maxima
(static input scales, KV cache scales) are exact in any order; tuning runs on rank 0 on every window, gathered, and
its weights are broadcast. What does not run distributed yet is refused in one line (:func:`check_distributable`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.distributed import share as comm
from quantkit.distributed.context import DistContext, SameOnEveryRank
from quantkit.distributed.plan import assign
from quantkit.distributed.reduce import CHUNK_BATCHES, batch_range, chunk_ranges, chunks_of
from quantkit.distributed.store import store_client, store_key, wait_key
from quantkit.format.scheme import QuantizedWeight
from quantkit.model.architectures import Stage
from quantkit.quantization.block_loop import BatchShare, Partials
from quantkit.quantization.config import QuantizeConfig

UNDISTRIBUTED_HINT = "run it as one process (plain `quantkit quantize`)"


def check_distributable(config: QuantizeConfig, context: DistContext) -> None:
    """Refuse, before any work, what does not run on several processes yet: the MSE observer's row sample of routed
    experts (each rank's first sampled row depends on how many tokens the router sent the experts on the ranks
    before it)."""
    if config.static_inputs and config.activation_observer == "mse" and config.moe_calibration == "routed":
        raise SameOnEveryRank(
            f"static input scales by the mse observer under --moe-calibration routed cannot run on {context.world} "
            f"processes yet; use --activation-observer minmax or --moe-calibration all, or {UNDISTRIBUTED_HINT}"
        )


@dataclass(slots=True)
class RankBlocks:
    """This rank's share of the calibration windows, and the exchanges of the block loop."""

    context: DistContext
    ranges: list[tuple[int, int]]  # each rank's chunks [first, stop) (the unit of the Hessians' summation tree)
    windows: list[int]  # each rank's number of windows
    batches: int  # mini-batches in all
    batch_size: int

    @classmethod
    def plan(cls, context: DistContext, num_windows: int, batch_size: int) -> RankBlocks:
        batches = -(-num_windows // batch_size)
        chunks = chunks_of(batches)
        if chunks < context.world:
            raise SameOnEveryRank(
                f"{num_windows} calibration windows make {batches} mini-batches of {batch_size}, {chunks} chunk(s) of "
                f"{CHUNK_BATCHES} for the Hessians' sums: fewer than the {context.world} processes (each takes whole "
                f"chunks); use at least {context.world * CHUNK_BATCHES * batch_size} windows, a smaller --batch-size "
                "or fewer processes"
            )
        ranges = chunk_ranges(chunks, context.world)
        windows = []
        for chunk in ranges:
            first, stop = batch_range(chunk, batches)
            windows.append(min(stop * batch_size, num_windows) - first * batch_size)
        return cls(context, ranges, windows, batches, batch_size)

    @property
    def chunks(self) -> int:
        return chunks_of(self.batches)

    @classmethod
    def data_free(cls, context: DistContext) -> RankBlocks:
        """A run without calibration windows: only the solves are shared out."""
        return cls(context, [(0, 0)] * context.world, [0] * context.world, 0, 1)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def rows(self) -> slice:
        """This rank's windows, of all of them."""
        first = self.ranges[self.rank][0] * CHUNK_BATCHES * self.batch_size
        return slice(first, first + self.windows[self.rank])

    def batch_share(self, holders: Callable[[Stage], set[int]]) -> BatchShare:
        """The stage loop's view: this rank's batches, and the exchange that gives each stage's solvers the
        Hessian's partial sums of every rank (and everyone the total row count)."""

        def finish(stage: Stage, own: Partials, count: int) -> tuple[Partials | None, int]:
            total_count = int(comm.all_sum(count))
            return exchange(stage, own), total_count

        def exchange(stage: Stage, own: Partials) -> Partials | None:
            return comm.exchange_partials(own, self.ranges, self.chunks, holders(stage), self.context)

        first = self.ranges[self.rank][0] * CHUNK_BATCHES
        return BatchShare(first=first, total=self.batches, finish=finish, exchange=exchange)

    def gather_first(self, local: torch.Tensor, count: int | None) -> torch.Tensor | None:
        """The first ``count`` windows of all (None: every one), from the ranks that hold them, on rank 0 (None on
        the others): what a transform reads, for rank 0 to transform the block on."""
        count = sum(self.windows) if count is None else min(count, sum(self.windows))
        counts, start = [], 0
        for held in self.windows:
            counts.append(max(0, min(held, count - start)))
            start += held
        return comm.gather_rows(local[: counts[self.rank]], counts, self.context)

    def share_block(self, block: torch.nn.Module) -> None:
        """Rank 0's float weights of ``block`` on every rank (after rank 0 alone transformed it)."""
        comm.broadcast_tensors_([p.data for _, p in sorted(block.named_parameters())], 0)

    def all_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, in place, the elementwise maximum over ranks (exact: the same bits as on one process)."""
        return comm.all_max_(tensor)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (small, picklable; tensors on the CPU), in rank order."""
        return comm.all_gather_object(value, self.context)

    def owners(self, costs: list[int]) -> list[int]:
        return assign(costs, self.context.world)

    def share_solved(self, solved: list[Any], owners: list[int], device: torch.device) -> list[Any]:
        """Every solve's result on every rank, each broadcast from the rank that solved it, in solve order."""
        out = []
        for result, owner in zip(solved, owners, strict=True):
            sent = [(_moved(w, torch.device("cpu")), r) for w, r in result] if owner == self.rank else None
            received = comm.broadcast_object(sent, owner)
            out.append(result if owner == self.rank else [(_moved(w, device), r) for w, r in received])
        return out

    def share_weights(
        self, weights: dict[str, QuantizedWeight] | None, device: torch.device
    ) -> dict[str, QuantizedWeight]:
        """Rank 0's quantized ``weights`` (None on the others) on every rank, on ``device``."""
        sent = None if weights is None else {name: _moved(w, torch.device("cpu")) for name, w in weights.items()}
        received = comm.broadcast_object(sent, 0)
        return weights if self.context.is_main else {name: _moved(w, device) for name, w in received.items()}

    def sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return comm.all_sum(counts).to(counts.dtype)

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's rows of ``local`` on rank 0 (None on the others), in window order."""
        return comm.gather_rows(local, self.windows, self.context)

    def scatter_rows(self, full: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """This rank's rows of ``full`` (held by rank 0)."""
        return comm.scatter_rows(full, self.windows, self.context, device)

    def decide(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what it read from the work directory)."""
        return comm.broadcast_object(value if self.context.is_main else None, 0)

    def rank_seconds(self, seconds: float) -> list[float]:
        return [float(s) for s in comm.all_gather_object(seconds, self.context)]


def _moved(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    """``weight`` with every tensor on ``device``."""
    changes = {
        f.name: getattr(weight, f.name).to(device)
        for f in dataclasses.fields(weight)
        if isinstance(getattr(weight, f.name), torch.Tensor)
    }
    return dataclasses.replace(weight, **changes)


def announce(context: DistContext, model: str, config: QuantizeConfig, output: Any) -> None:
    """In a recipe run, where rank 0 alone runs the recipe, hand the job to the other ranks waiting in
    :func:`serve_jobs` (a ``quantize`` command runs on every rank by itself: nothing to hand)."""
    if context.is_main and context.driving:
        _call_in(context, (model, config, output))


def serve_jobs(context: DistContext) -> None:
    """The other ranks of a recipe run: quantize each job rank 0 hands over, until it says the recipe is done.
    Between jobs they wait on the job's store, not in a collective (whose timeout a long evaluation could pass)."""
    from quantkit.quantization.pipeline import quantize_model

    store = store_client()
    while True:
        if store is not None:
            wait_key(store, f"job/{context.jobs}")
        context.jobs += 1
        job = comm.broadcast_object(None, 0)
        if job is None:
            return
        model, config, output = job
        quantize_model(model, config, output)


def release_workers(context: DistContext) -> None:
    """Rank 0 of a recipe run: tell the waiting ranks that no more jobs come."""
    if context.is_main and context.driving:
        _call_in(context, None)


def _call_in(context: DistContext, job: Any) -> None:
    store = store_client()
    if store is not None:
        store.set(store_key(f"job/{context.jobs}"), "1")
    context.jobs += 1
    comm.broadcast_object(job, 0)
