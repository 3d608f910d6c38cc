"""This process's place in a ``torchrun`` job, and the process group's lifetime.

``torchrun --nproc-per-node N -m quantkit ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` in every worker; :func:`distributed_session` reads them, starts the process group (gloo on CPUs,
NCCL on GPUs) with a timeout so that a collective never waits forever on a dead rank, starts the watchdog that stops
every rank when one fails, and destroys the group on the way out. Without those variables (a plain ``quantkit``
run, or ``torchrun`` with one process) nothing is started and :func:`current` is None: the single-process path.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch

from quantkit.errors import QuantkitError

# How long a collective may wait for the other ranks: it must outlast the longest solve another rank runs while the
# waiting ones sit in the broadcast of its result (a dead rank is noticed by the watchdog long before this).
DEFAULT_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "QUANTKIT_DIST_TIMEOUT"


class SameOnEveryRank(QuantkitError):
    """A user error every rank raises alike (a refused option): rank 0 alone prints it."""


@dataclass(slots=True)
class DistContext:
    """Where this process stands in the job; ``rank`` 0 alone writes files and prints progress."""

    rank: int
    world: int
    local_rank: int = 0
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    driving: bool = False  # rank 0 runs a recipe alone and hands each quantize job to the other ranks
    jobs: int = 0  # the jobs handed over so far (each a key in the job's store)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_CURRENT: DistContext | None = None  # set while a distributed session is open (torch.distributed's state is global)


def current() -> DistContext | None:
    """The open distributed session, or None in a single-process run."""
    return _CURRENT


def is_main_process() -> bool:
    """Whether this process reports and writes: rank 0, or the only process."""
    return _CURRENT is None or _CURRENT.is_main


def refuse_under_torchrun(what: str) -> None:
    """Stop, in one line, work that does not run on several processes."""
    if _CURRENT is not None:
        raise SameOnEveryRank(
            f"{what} cannot run on {_CURRENT.world} processes; run it as one process (without torchrun)"
        )


def world_from_env(env: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun with more than one process, else None."""
    env = dict(os.environ) if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    except ValueError as exc:
        raise QuantkitError(f"RANK/WORLD_SIZE must be integers (got {env['RANK']!r}, {env['WORLD_SIZE']!r})") from exc
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise QuantkitError(f"RANK {rank} is outside WORLD_SIZE {world}; launch with torchrun")
    return rank, world, local


def rank_label() -> str:
    """``"rank R: "`` in a process torchrun started with several ranks (for its one-line messages), else ``""``."""
    try:
        found = world_from_env()
    except QuantkitError:
        return ""
    return "" if found is None else f"rank {found[0]}: "


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise QuantkitError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


@contextmanager
def distributed_session() -> Iterator[DistContext | None]:
    """Open the process group when torchrun started this process (yield its context), else yield None."""
    global _CURRENT
    found = world_from_env()
    if found is None or _CURRENT is not None:
        yield _CURRENT
        return
    import torch.distributed as dist

    from quantkit.distributed.watchdog import Watchdog

    rank, world, local = found
    if not faulthandler.is_enabled():  # a native abort in any rank prints every thread's Python stack, not one line
        faulthandler.enable(all_threads=True)
    # CPU tensors (the CPU path, small metadata) over gloo; CUDA tensors over NCCL where there is a GPU
    nccl = torch.cuda.is_available() and dist.is_nccl_available()
    backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
    timeout = timeout_from_env()
    if nccl:
        torch.cuda.set_device(local)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    context = DistContext(rank, world, local, backend, timeout)
    _CURRENT = context
    watchdog = Watchdog(context)
    try:
        with watchdog:
            yield context
    finally:
        _CURRENT = None
        dist.destroy_process_group()
