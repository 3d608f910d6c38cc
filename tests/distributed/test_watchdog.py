"""The watchdog's way out, against a real job store (a TCPStore served in this process): a rank other than 0 that
finished waits for rank 0 to finish before it leaves, so no rank tears its connections down while rank 0 still
writes the checkpoint; rank 0 and a failed rank do not wait."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import nullcontext
from datetime import timedelta

import pytest
import torch.distributed as dist

from quantkit.distributed.context import DistContext
from quantkit.distributed.store import store_key
from quantkit.distributed.watchdog import Watchdog

RANK0_WORKS_S = 1.5


@pytest.fixture
def job_store(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"watchdog-test-{port}")
    return server


def _rank0_finishes_later(store) -> threading.Timer:
    timer = threading.Timer(RANK0_WORKS_S, lambda: store.set(store_key("done/0"), "1"))
    timer.start()
    return timer


def test_a_finished_rank_waits_for_rank_0_before_it_leaves(job_store) -> None:
    timer = _rank0_finishes_later(job_store)
    start = time.monotonic()
    with Watchdog(DistContext(rank=1, world=2)):
        pass
    assert time.monotonic() - start >= RANK0_WORKS_S * 0.9
    assert job_store.check([store_key("done/1")])
    timer.join()


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_and_a_failed_rank_leave_at_once(job_store, rank: int) -> None:
    timer = _rank0_finishes_later(job_store)
    start = time.monotonic()
    with pytest.raises(RuntimeError) if rank == 1 else nullcontext(), Watchdog(DistContext(rank=rank, world=2)):
        if rank == 1:
            raise RuntimeError("solver failed")
    assert time.monotonic() - start < RANK0_WORKS_S * 0.5
    if rank == 1:
        assert job_store.get(store_key("failed")).decode() == "rank 1 failed: RuntimeError: solver failed"
    else:
        assert job_store.check([store_key("done/0")])
    timer.cancel()
