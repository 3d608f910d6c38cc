"""The engine on its own thread, fed from the event loop.

Every engine call (tokenizing, chat templates, add, abort, step) runs on the engine thread, so the engine and
its tokenizer are never used from two threads. The event loop submits commands and reads each request's
outputs from its own ``asyncio.Queue``. Requests in flight are bounded (running batch + ``max_queue``): one
more is refused with 429 instead of growing memory without limit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.runtime.engine import Engine, RequestOutput
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import FinishReason
from quantkit.server.metrics import Metrics
from quantkit.server.protocol import APIError, scrub_paths

_log = logging.getLogger(__name__)
_IDLE_POLL_S = 0.05  # the idle engine thread wakes this often to notice stop()
_DISCONNECT_POLL_S = 1.0  # a non-streaming request checks its client this often

Build = Callable[[Engine], tuple["str | list[int]", SamplingParams]]


@dataclass(slots=True, frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 0
    spec_acceptance: float = 0.0  # accepted / drafted tokens so far (speculative decoding)
    spec_tokens_per_step: float = 0.0  # tokens per target pass of a sequence with drafts
    preemptions: int = 0  # sequences preempted so far


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        metrics: Metrics | None = None,
        redact: Callable[[str], str] = scrub_paths,
    ) -> None:
        engine.stream_text = True  # decode every step: streamed deltas
        self.engine = engine
        self.redact = redact  # engine messages name the model's directory: hidden before a client sees them
        self.metrics = metrics or Metrics()
        self.max_in_flight = engine.config.max_num_seqs + max_queue
        self.num_in_flight = 0  # requests added and not yet cleaned up (event loop only)
        self.stats = EngineStats(free_blocks=engine.block_manager.num_free_blocks)
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # request -> completion tokens counted in the metrics so far (-1: not even its prompt); cleaned up with it
        self._counted: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._closed: APIError | None = None  # set by close(): every request in flight or new gets this error

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

    def close(self, error: APIError) -> None:
        """From any thread: end every request in flight with ``error`` (and refuse new ones); each is aborted
        as its handler leaves. Used when the drain time after SIGTERM has run out."""
        self._call_soon(self._close, error)

    def _close(self, error: APIError) -> None:
        self._closed = error
        self._fail_all(error)

    # ----------------------------------------------------------------- requests (event loop side)
    async def add(self, build: Build) -> str:
        """Queue a request built on the engine thread; APIError 429 when full, 400 when the engine refuses it."""
        if self.num_in_flight >= self.max_in_flight:
            raise APIError(
                429, f"the server queue is full ({self.max_in_flight} requests); retry later", "rate_limit_error",
                code="queue_full",
            )  # fmt: skip
        if self._closed is not None:
            raise self._closed
        rid = uuid.uuid4().hex
        self._streams[rid] = asyncio.Queue()
        self._counted[rid] = -1
        self.num_in_flight += 1

        def add(engine: Engine) -> None:
            prompt, params = build(engine)
            engine.add_request(prompt, params, request_id=rid)

        try:
            await asyncio.wrap_future(self._submit(add))
        except QuantkitError as exc:
            self.cleanup(rid, finished=True)
            raise bad_request(self.redact(str(exc))) from None
        except BaseException:
            self.cleanup(rid, finished=True)
            raise
        return rid

    async def outputs(
        self, rid: str, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """A request's outputs until it finishes; leaving early (or a gone client) aborts it."""
        stream = self._streams.get(rid)
        finished = False
        try:
            while stream is not None:
                if is_disconnected is None:
                    out = await stream.get()
                else:
                    try:
                        out = await asyncio.wait_for(stream.get(), _DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        if await is_disconnected():
                            return
                        continue
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.cleanup(rid, finished)

    def cleanup(self, rid: str, finished: bool = False) -> None:
        """Release a request's slot (idempotent); an unfinished one is aborted, freeing its KV blocks."""
        self._counted.pop(rid, None)
        if self._streams.pop(rid, None) is None:
            return
        self.num_in_flight -= 1
        if not finished:
            self._submit(lambda engine: engine.abort(rid))

    def _submit(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._commands.put((fn, fut))
        return fut

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            if out.error is not None:
                out.error = self.redact(out.error)
            else:
                self._count(out)
            if out.finished and out.error is None:
                reason = "length" if out.finish_reason is FinishReason.LENGTH else "stop"
                self.metrics.observe_finished(
                    reason, len(out.token_ids), out.arrival_time, out.first_token_time, out.finish_time
                )
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(out)

    def _count(self, out: RequestOutput) -> None:
        """Token counters: the prompt once its prefill is done (the first output), generated tokens as they come
        (an output arriving after its request was cleaned up, aborted, is not counted)."""
        counted = self._counted.get(out.request_id)
        if counted is None:
            return
        prompt = len(out.prompt_token_ids) if counted < 0 else 0
        counted = max(counted, 0)
        self.metrics.count_tokens(prompt, max(0, len(out.token_ids) - counted))
        if out.finished:
            del self._counted[out.request_id]
        else:
            self._counted[out.request_id] = max(counted, len(out.token_ids))

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)

    # ----------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            busy = engine.has_unfinished() and self._unpaused.is_set()
            self._run_commands(block=not busy)
            if not (engine.has_unfinished() and self._unpaused.is_set()):
                self._publish_stats()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # an engine bug: fail what is in flight, keep serving new requests
                _log.exception("engine step failed")
                for rid in list(self._streams):
                    engine.abort(rid)
                error = APIError(500, self.redact(f"engine failure: {exc}"), "server_error")
                self._call_soon(self._fail_all, error)
                continue
            self._publish_stats()
            if outputs:
                self._call_soon(self._dispatch, outputs)

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
        sched, bm, spec = self.engine.scheduler, self.engine.block_manager, self.engine.spec_stats
        self.stats = EngineStats(
            sched.num_running, sched.num_waiting, bm.usage, bm.num_free_blocks, spec.acceptance_rate,
            spec.tokens_per_step, self.engine.num_preemptions,
        )  # fmt: skip

    def _call_soon(self, fn: Callable[..., None], arg: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, arg)


def bad_request(message: str) -> APIError:
    if "max_model_len" in message or "KV blocks" in message:
        return APIError(400, message, param="prompt", code="context_length_exceeded")
    return APIError(400, message, param="prompt" if "prompt" in message else None)
