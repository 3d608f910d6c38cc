"""The engine on its own thread: commands in (run there in order), outputs out (to the event loop), health and
stats published for ``/health`` and ``/metrics``.

Every engine call (add, abort, step) runs on this thread, so the engine is never used from two threads. An exception
escaping ``engine.step()`` (an engine bug: batch failures are handled inside the engine) fails the requests in
flight and is counted; the thread keeps serving. If the thread itself dies, every request in flight and every new
one gets 503, and ``/health`` says so.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from quantkit.runtime.engine import Engine, RequestOutput

_log = logging.getLogger("quantkit.server.async_engine")
_IDLE_POLL_S = 0.05  # the idle engine thread wakes this often to notice stop()
UNHEALTHY_AFTER = 3  # consecutive failed steps after which /health reports the engine unhealthy


@dataclass(slots=True, frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 0
    spec_acceptance: float = 0.0  # accepted / drafted tokens so far (speculative decoding)
    spec_tokens_per_step: float = 0.0  # tokens per target pass of a sequence with drafts
    preemptions: int = 0  # sequences preempted so far
    failed_steps: int = 0  # steps in which every request failed, or that raised
    consecutive_failed_steps: int = 0  # the same, since the last step in which a request succeeded


class EngineThread(ABC):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stats = EngineStats(free_blocks=engine.block_manager.num_free_blocks)
        self.step_exceptions = 0  # exceptions that escaped engine.step()
        self._consecutive_exceptions = 0
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]]] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self.dead = False  # the thread died (event loop side)

    # ----------------------------------------------------------------- lifecycle (event loop side)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._unpaused.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def pause(self) -> None:
        """Stop stepping (requests still queue up); for tests and maintenance."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def health(self) -> str | None:
        """None when the engine serves; else why not (for ``/health``)."""
        if self.dead or self._thread is None or not self._thread.is_alive():
            return "the engine thread is not running"
        failed = self.stats.consecutive_failed_steps
        if failed >= UNHEALTHY_AFTER:
            return f"the last {failed} engine steps failed (see the server log)"
        return None

    def command(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the engine thread, in order with the other commands."""
        fut: Future[Any] = Future()
        self._commands.put((fn, fut))
        return fut

    # ----------------------------------------------------------------- hooks (event loop side)
    @abstractmethod
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    @abstractmethod
    def on_step_exception(self, _: None) -> None:
        """``engine.step()`` raised: the requests in flight are already aborted in the engine."""
        raise NotImplementedError

    @abstractmethod
    def on_death(self, _: None) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # logged here; the thread ends, and the event loop learns of it
            _log.exception("the engine thread died; the server answers 503 until it is restarted")
            self._call_soon(self._died, None)

    def _died(self, _: None) -> None:
        self.dead = True
        self.on_death(None)

    def _serve(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            busy = engine.has_unfinished() and self._unpaused.is_set()
            self._run_commands(block=not busy)
            if not (engine.has_unfinished() and self._unpaused.is_set()):
                self._publish_stats()
                continue
            try:
                outputs = engine.step()
            except Exception:  # an engine bug: fail what is in flight, keep serving new requests
                _log.exception("engine step failed; failing the requests in flight")
                self.step_exceptions += 1
                self._consecutive_exceptions += 1
                for rid in engine.output_processor.request_ids():
                    engine.abort(rid)
                self._publish_stats()
                self._call_soon(self.on_step_exception, None)
                continue
            self._consecutive_exceptions = 0
            self._publish_stats()
            if outputs:
                self._call_soon(self.on_outputs, outputs)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            try:
                result = fn(self.engine)
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish_stats(self) -> None:
        engine = self.engine
        sched, bm, spec = engine.scheduler, engine.block_manager, engine.spec_stats
        self.stats = EngineStats(
            sched.num_running, sched.num_waiting, bm.usage, bm.num_free_blocks, spec.acceptance_rate,
            spec.tokens_per_step, engine.num_preemptions, engine.num_failed_steps + self.step_exceptions,
            max(engine.consecutive_failed_steps, self._consecutive_exceptions),
        )  # fmt: skip

    def _call_soon(self, fn: Callable[..., None], arg: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, arg)
