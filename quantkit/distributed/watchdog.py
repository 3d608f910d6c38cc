"""Stop every rank, within a bounded time, when one fails.

Each rank runs a thread that beats (increments its counter in the job's key-value store, the one torchrun's
rendezvous provides) once a second and watches the others. A rank that raises records ``rank R: cause`` under
``failed`` on its way out; a rank killed outright (``kill -9``, a lost node) stops beating. Either way every other
rank's watchdog sees it within :data:`POLL_S` (a failure) or :data:`STALE_S` (silence), prints one line naming the
rank and the cause, and ends its process, even while it waits inside a collective (whose own timeout is much
longer: it must outlast the longest solve another rank runs). A rank that finished its work says so (``done``) and
is not waited for; a rank other than 0 that finished waits, still watched, for rank 0's ``done`` before it leaves.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from quantkit.distributed.store import store_client, store_key

if TYPE_CHECKING:
    from quantkit.distributed.context import DistContext

POLL_S = 0.5
STALE_S = float(os.environ.get("QUANTKIT_DIST_STALE", "30"))  # silence that means a rank is gone
EXIT_PEER_FAILED = 3


class Watchdog:
    def __init__(self, context: DistContext) -> None:
        self.context = context
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None

    def __enter__(self) -> Watchdog:
        self._store = store_client()
        if self._store is None:  # no store to talk through: the process group's timeout is the only bound
            return self
        self._thread = threading.Thread(target=self._run, name="quantkit-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if _succeeded(exc):
            self._await_main_rank()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._store is None:
            return
        try:
            if _succeeded(exc):
                self._store.set(store_key(f"done/{self.context.rank}"), "1")
            else:
                self._store.set(store_key("failed"), f"rank {self.context.rank} failed: {failure_cause(exc)}")
        except Exception:  # (the store may be gone with rank 0; the others notice the silence)
            pass
        # the store's connection is closed now, while the interpreter is whole, not by its finalisation
        self._store = None

    def _await_main_rank(self) -> None:
        """A rank other than 0 that finished its work waits, still watched, until rank 0 has finished too (its files
        written): no rank tears its connections down while rank 0 still works, and a fault in one rank's teardown
        cannot cut rank 0's writing short."""
        if self._store is None or self.context.rank == 0:
            return
        from quantkit.distributed.store import wait_key

        with contextlib.suppress(Exception):  # (the store is gone with the launcher: nothing left to wait for)
            wait_key(self._store, "done/0")

    def _run(self) -> None:
        rank, world = self.context.rank, self.context.world
        beats = 0
        seen: dict[int, tuple[str, float]] = {}
        while not self._stop.wait(POLL_S):
            try:
                beats += 1
                self._store.set(store_key(f"beat/{rank}"), str(beats))
                if self._store.check([store_key("failed")]):
                    _stop_process(f"stopped because {self._store.get(store_key('failed')).decode()}")
                now = time.monotonic()
                for other in range(world):
                    if other == rank or self._store.check([store_key(f"done/{other}")]):
                        continue
                    beat = self._store.get(store_key(f"beat/{other}")).decode() if self._beating(other) else ""
                    last = seen.get(other)
                    if last is None or last[0] != beat:
                        seen[other] = (beat, now)
                    elif now - last[1] > STALE_S:
                        _stop_process(
                            f"stopped because rank {other} stopped responding for {STALE_S:.0f} s (killed, or its "
                            "node is gone)"
                        )
            except Exception as exc:  # (the store lives with the launcher or rank 0: it is gone)
                if self._stop.is_set():
                    return
                _stop_process(f"stopped: lost the job's store ({type(exc).__name__}): the launcher or rank 0 died")

    def _beating(self, other: int) -> bool:
        return bool(self._store.check([store_key(f"beat/{other}")]))


def _succeeded(exc: BaseException | None) -> bool:
    return exc is None or (isinstance(exc, SystemExit) and not exc.code)


def failure_cause(exc: BaseException | None) -> str:
    """One line: the exception's type and message (a KeyboardInterrupt: interrupted)."""
    if exc is None:
        return "unknown failure"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, SystemExit):
        return f"exited with status {exc.code}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _stop_process(line: str) -> None:
    """End this process now from the watchdog thread (the main thread may be blocked inside a collective)."""
    from quantkit.distributed.context import rank_label

    sys.stderr.write(f"error: {rank_label()}{line}\n")
    sys.stderr.flush()
    os._exit(EXIT_PEER_FAILED)
