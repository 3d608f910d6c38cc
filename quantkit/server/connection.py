"""Connection limits uvicorn lacks, in a subclass of its h11 protocol (``uvicorn.Config(http=...)``).

* Header timeout: a connection must send a whole request head within ``header_timeout`` seconds of opening (or of
  the first byte of its next request); else it gets 408 and is closed. uvicorn times out idle keep-alive connections
  only, so a client trickling header bytes (slow-loris) would hold its file descriptor forever.
* Write timeout: a connection whose writes stay paused (its client reads nothing; the socket's send buffer and the
  transport's are full) for ``write_timeout`` seconds is aborted. Starlette then sees a disconnect and cancels the
  response: a streamed request is aborted and its KV blocks freed. A connection closed with unsent data is also
  aborted after ``write_timeout`` (asyncio's ``close()`` otherwise waits for a client that never reads).
* The socket's send buffer is fixed at ``SEND_BUFFER_BYTES`` instead of growing with TCP autotuning (to MBs on
  loopback), so a client that stops reading is noticed after about that much unread output.
* Connections beyond ``max_connections`` are answered 503 (an OpenAI error object) and closed at once.
* A malformed request head, or one over ``max_header_bytes``, gets 400 with an error object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from quantkit.server.metrics import Metrics
from quantkit.server.protocol import APIError

SEND_BUFFER_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float
    write_timeout: float
    max_connections: int
    max_header_bytes: int


def guarded_protocol(limits: ConnectionLimits, metrics: Metrics) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits``, counting in ``metrics``."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"limits": limits, "metrics": metrics})


def _response(status: int, reason: str, error: APIError) -> bytes:
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


_TOO_MANY = _response(503, "Service Unavailable", APIError(
    503, "the server has too many open connections (its --max-connections); retry later", "server_error",
    code="too_many_connections",
))  # fmt: skip
_HEAD_TIMEOUT = _response(408, "Request Timeout", APIError(
    408, "the request head did not arrive within the server's --header-timeout; send the request line and headers "
    "at once", code="request_timeout",
))  # fmt: skip
_BAD_HEAD = _response(400, "Bad Request", APIError(
    400, "invalid HTTP request: a malformed request line or header, or a request head over the server's "
    "--max-header-bytes; send a valid, shorter request head", code="invalid_http_request",
))  # fmt: skip


class _DeadlineTransport:
    """A transport whose ``close()`` with unsent data turns into ``abort()`` after ``timeout`` seconds."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._transport, self._loop, self._timeout = transport, loop, timeout

    def close(self) -> None:
        self._transport.close()
        if self._transport.get_write_buffer_size():
            self._loop.call_later(self._timeout, self._transport.abort)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _GuardedH11Protocol(H11Protocol):
    limits: ConnectionLimits
    metrics: Metrics

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # received since the last request head was complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not a TCP socket (a unix socket): nothing to bound
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(_DeadlineTransport(transport, self.loop, self.limits.write_timeout))  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            self.metrics.connections_refused += 1
            self.transport.write(_TOO_MANY)
            self.transport.close()
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # for a request head
        if waiting:
            if self._head_timer is None:
                self._arm_head_timer()  # the first bytes of the next request on a kept-alive connection
            self._head_bytes += len(data)
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a whole request head arrived: the body has its own timeout (the gate)
            self._cancel("_head_timer")
            self._head_bytes = 0
        elif waiting and self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self.send_400_response("request head too large")  # h11 limits a head it receives in pieces only

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_head_timer")
        self._cancel("_write_timer")
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_write_timer")

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_BAD_HEAD)
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.metrics.header_timeouts += 1
            self.transport.write(_HEAD_TIMEOUT)
            self.transport.close()

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing() or self.transport.get_write_buffer_size():
            self.metrics.write_timeouts += 1
            self.transport.abort()

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)
