"""The job's key-value store (the one torchrun's rendezvous serves at ``MASTER_ADDR:MASTER_PORT``), reached through
connections of our own: the watchdog's heartbeats and failures, and a recipe's rank 0 calling the other ranks in
(waiting on a key costs nothing, unlike a collective, whose timeout would cut a long evaluation on rank 0 short)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

_PREFIX = "quantkit/"
WAIT_CHUNK_S = 60.0


def store_key(name: str) -> str:
    """Keys of this attempt only: torchrun may restart the job on the same store (``--max-restarts``)."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return _PREFIX + attempt + name


def store_client() -> Any:
    """A new client connection to the job's store; None when its address is not in the environment or nothing
    answers there."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    except Exception:  # (no store reachable: the process group's timeout remains the only bound)
        return None


def wait_key(store: Any, name: str) -> None:
    """Block until ``name`` is set, however long that takes (the watchdog ends the process if a rank fails)."""
    key = store_key(name)
    while True:
        try:
            store.wait([key], timedelta(seconds=WAIT_CHUNK_S))
            return
        except RuntimeError as exc:  # a chunk's timeout: wait again; anything else is a real failure
            if "timeout" not in str(exc).lower():
                raise
