"""Requests between the event loop and the engine thread (:mod:`quantkit.server.engine_thread`).

A request first takes a slot (:meth:`AsyncEngine.reserve`: 429 when the server is full, before any tokenizing),
then is queued on the engine (:meth:`AsyncEngine.submit`), then its outputs are read (:meth:`AsyncEngine.outputs`).

* Slots: running batch + ``max_queue``. A slot is freed as soon as the engine is done with the request, whether or
  not its client has read the answer. When the server is full, a request from an API key (tenant) that holds fewer
  slots than the key holding the most pushes out that key's newest request that has not produced anything yet
  (it gets 429): one key's flood cannot lock the others out.
* Outputs are cumulative (each holds the whole completion so far), so a request keeps only the latest one it has
  not read: a client that reads slowly, or not at all, costs one output, not one per step.
* Engine failures reach clients as a generic error naming the request id (the server log has the details): no
  exception text, device or path leaves the server.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError
from quantkit.runtime.engine import Engine, RequestOutput
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import FinishReason
from quantkit.server.engine_thread import EngineStats, EngineThread
from quantkit.server.metrics import Metrics
from quantkit.server.protocol import APIError, internal_error, scrub_paths

__all__ = ["AsyncEngine", "EngineStats", "bad_request"]

_DISCONNECT_POLL_S = 1.0  # a request waiting for output checks its client this often


@dataclass(slots=True, eq=False)
class _Request:
    rid: str
    tenant: str
    priority: int = 0
    latest: RequestOutput | None = None  # the newest output not read yet
    error: APIError | None = None  # ends the request (read before any output still unread)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    counted: int = -1  # completion tokens counted in the metrics so far (-1: not even its prompt)
    started: bool = False  # produced an output: never pushed out
    released: bool = False  # its slot is free (the engine is done with it, or it was pushed out)
    queue_observed: bool = False


class AsyncEngine(EngineThread):
    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        metrics: Metrics | None = None,
        redact: Callable[[str], str] = scrub_paths,
    ) -> None:
        super().__init__(engine)
        engine.stream_text = True  # decode every step: streamed deltas
        self.redact = redact  # engine messages name the model's directory: hidden before a client sees them
        self.metrics = metrics or Metrics()
        self.max_in_flight = engine.config.max_num_seqs + max_queue
        self.num_in_flight = 0  # slots taken (event loop only)
        self._slots: Counter[str] = Counter()  # tenant -> slots taken
        self._requests: dict[str, _Request] = {}  # in reservation order
        self._closed: APIError | None = None  # set by close(): every request in flight or new gets this error

    # ----------------------------------------------------------------- lifecycle (event loop side)
    def close(self, error: APIError) -> None:
        """From any thread: end every request in flight with ``error`` (and refuse new ones); each is aborted
        as its handler leaves. Used when the drain time after SIGTERM has run out."""
        self._call_soon(self._close, error)

    def _close(self, error: APIError) -> None:
        self._closed = error
        self._fail_all(lambda _: error)

    def on_death(self, _: None) -> None:
        self._fail_all(lambda req: internal_error(req.rid, 503))

    def on_step_exception(self, _: None) -> None:
        self._fail_all(lambda req: internal_error(req.rid))

    # ----------------------------------------------------------------- requests (event loop side)
    def reserve(self, tenant: str = "", priority: int = 0) -> str:
        """A slot for a new request; its id. APIError 429 when the server is full, 503 when it cannot serve."""
        if self._closed is not None:
            raise self._closed
        if self.dead:
            raise APIError(503, "the engine is not running; retry later", "server_error", code="engine_unavailable")
        if self.num_in_flight >= self.max_in_flight and not self._push_out(tenant):
            raise APIError(
                429, f"the server queue is full ({self.max_in_flight} requests); retry later", "rate_limit_error",
                code="queue_full",
            )  # fmt: skip
        rid = uuid.uuid4().hex
        self._requests[rid] = _Request(rid, tenant, priority)
        self._slots[tenant] += 1
        self.num_in_flight += 1
        return rid

    async def submit(
        self, rid: str, prompt: str | list[int], params: SamplingParams, cache_salt: bytes | None = None
    ) -> None:
        """Queue a reserved request on the engine; APIError 400 when the engine refuses it."""
        req = self._requests.get(rid)
        assert req is not None, "submit() takes a request reserve() returned"
        if req.error is not None:  # pushed out (or the server closed) while it was tokenized
            self.cleanup(rid, finished=True)
            raise req.error

        def add(engine: Engine) -> None:
            if req.error is None:  # not pushed out meanwhile (its abort is queued after this command)
                engine.add_request(prompt, params, rid, priority=req.priority, tenant=req.tenant, cache_salt=cache_salt)

        try:
            await asyncio.wrap_future(self.command(add))
        except QuantkitError as exc:
            self.cleanup(rid, finished=True)
            raise bad_request(self.redact(str(exc))) from None
        except BaseException:
            self.cleanup(rid, finished=True)
            raise

    async def wait_started(self, rid: str, is_disconnected: Callable[[], Awaitable[bool]]) -> RequestOutput | None:
        """The request's first output, left unread (its error is raised as APIError); None when the client left."""
        req = self._requests.get(rid)
        while req is not None and req.latest is None and req.error is None:
            if not await self._wait(req, is_disconnected):
                return None
        if req is None:
            return None
        if req.error is not None:
            raise req.error
        return req.latest

    async def outputs(
        self, rid: str, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """A request's outputs until it finishes (consecutive outputs a slow reader missed are skipped: each holds
        everything before it); leaving early (or a gone client) aborts it."""
        req = self._requests.get(rid)
        finished = False
        try:
            while req is not None:
                if req.error is not None:
                    raise req.error
                if req.latest is None:
                    if not await self._wait(req, is_disconnected):
                        return
                    continue
                out, req.latest = req.latest, None
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.cleanup(rid, finished)

    async def _wait(self, req: _Request, is_disconnected: Callable[[], Awaitable[bool]] | None) -> bool:
        """Until the request has news; False when its client has gone."""
        req.wake.clear()
        if is_disconnected is None:
            await req.wake.wait()
            return True
        try:
            await asyncio.wait_for(req.wake.wait(), _DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            return not await is_disconnected()
        return True

    def cleanup(self, rid: str, finished: bool = False) -> None:
        """Forget a request (idempotent); an unfinished one is aborted, freeing its KV blocks."""
        req = self._requests.pop(rid, None)
        if req is None:
            return
        self._release(req)
        if not finished:
            self.command(lambda engine: engine.abort(rid))

    def _release(self, req: _Request) -> None:
        if not req.released:
            req.released = True
            self.num_in_flight -= 1
            self._slots[req.tenant] -= 1
            if not self._slots[req.tenant]:
                del self._slots[req.tenant]

    def _push_out(self, tenant: str) -> bool:
        """Free a slot for ``tenant`` from the tenant holding the most, if it holds more (see the module docstring)."""
        if not self._slots:
            return False
        heaviest, held = self._slots.most_common(1)[0]
        if heaviest == tenant or self._slots[tenant] + 1 >= held:
            return False
        for req in reversed(self._requests.values()):
            if req.tenant == heaviest and not req.started and not req.released:
                req.error = APIError(
                    429, "the server queue is full and this request was the newest of the API key holding the most "
                    "requests; retry later, or send fewer requests at once", "rate_limit_error", code="queue_full",
                )  # fmt: skip
                req.wake.set()
                self._release(req)
                self.metrics.pushed_out += 1
                self.command(lambda engine, rid=req.rid: engine.abort(rid))
                return True
        return False

    def _fail_all(self, error: Callable[[_Request], APIError]) -> None:
        """End every request the engine still works on (one it has finished keeps its answer)."""
        for req in self._requests.values():
            if req.error is None and not req.released:
                req.error = error(req)
                req.wake.set()

    # ----------------------------------------------------------------- outputs (event loop side)
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            req = self._requests.get(out.request_id)
            if out.error is None and req is not None:
                self._count(req, out)
            if req is not None and not req.queue_observed and out.first_scheduled_time is not None:
                req.queue_observed = True
                self.metrics.observe_queue(req.priority, out.first_scheduled_time - out.arrival_time)
            if out.finished:
                self._observe_finished(out)
            if req is None:
                continue  # cleaned up (aborted) meanwhile
            req.started = True
            req.latest = out
            req.wake.set()
            if out.finished:
                self._release(req)

    def _observe_finished(self, out: RequestOutput) -> None:
        if out.finish_reason is FinishReason.ERROR:
            self.metrics.request_errors += 1
            return
        reason = "length" if out.finish_reason is FinishReason.LENGTH else "stop"
        self.metrics.observe_finished(
            reason, len(out.token_ids), out.arrival_time, out.first_token_time, out.finish_time
        )  # fmt: skip

    def _count(self, req: _Request, out: RequestOutput) -> None:
        """Token counters: the prompt once its prefill is done (the first output), generated tokens as they come
        (an output arriving after its request was cleaned up, aborted, is not counted)."""
        prompt = len(out.prompt_token_ids) if req.counted < 0 else 0
        counted = max(req.counted, 0)
        self.metrics.count_tokens(prompt, max(0, len(out.token_ids) - counted))
        req.counted = max(counted, len(out.token_ids))


def bad_request(message: str) -> APIError:
    if "max_model_len" in message or "KV blocks" in message:
        return APIError(400, message, param="prompt", code="context_length_exceeded")
    for param in ("stop_token_ids", "logit_bias", "priority", "prompt"):
        if param in message:
            return APIError(400, message, param=param)
    return APIError(400, message)
