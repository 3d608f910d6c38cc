"""The outermost middleware: 400 for a request head over --max-header-bytes, 503 while draining, 401 without an API key
(and the request's tenant: which key sent it), the request body read whole under a size and a time limit (413 / 408)
before anything parses it, and every request counted by route and status."""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quantkit.server.protocol import APIError
from quantkit.server.state import ServerState

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")  # counted by name


class Gate:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        status = 500  # an exception escaping the app becomes a 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self._refuse(scope, path)
            if error is None and scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await read_body(scope, receive, self.state.max_body_bytes, self.state.body_timeout)
                if isinstance(body, APIError):
                    error = body
                else:
                    receive = _replay(body, receive)
            if error is None:
                await self.app(scope, receive, counted)
            else:
                headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
                if error.status in (408, 413):  # the rest of the body is never read: close, do not drain it
                    headers = {"Connection": "close"}
                await JSONResponse(error.body(), error.status, headers)(scope, receive, counted)
        finally:
            self.state.metrics.count_request(path if path in ROUTES else "other", status)

    def _refuse(self, scope: Scope, path: str) -> APIError | None:
        head = len(scope.get("raw_path", b"")) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > self.state.max_header_bytes:  # arrived whole: the protocol limits a head arriving in pieces
            return APIError(
                400, f"the request head has {head} bytes, more than the server's --max-header-bytes "
                f"({self.state.max_header_bytes}); send fewer or shorter headers", code="invalid_http_request",
            )  # fmt: skip
        keys = self.state.api_keys
        if keys and path != "/health":
            tenant = _tenant(keys, dict(scope["headers"]).get(b"authorization", b""))
            if tenant is None:
                return APIError(
                    401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )  # fmt: skip
            scope.setdefault("state", {})["tenant"] = tenant  # request.state.tenant in the routes
        if self.state.draining and path.startswith("/v1/"):
            return APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        return None


def _tenant(keys: dict[bytes, str], authorization: bytes) -> str | None:
    """The tenant of the key in a ``Bearer <key>`` header; None when it names no key. The scheme is case-insensitive
    (RFC 9110); the key is compared as the UTF-8 bytes sent, against every key in constant time."""
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    found = None
    for key, tenant in keys.items():
        if hmac.compare_digest(token, key):
            found = tenant
    return found


async def read_body(scope: Scope, receive: Receive, limit: int, timeout: float) -> bytes | APIError:
    """The whole request body, or a 413 error as soon as it is known to exceed ``limit`` bytes: from its
    Content-Length before anything is read, else once the bytes read pass it (nothing is parsed before); a 408
    error when the whole body has not arrived within ``timeout`` seconds (a slow client holds no connection)."""
    too_big = APIError(
        413, f"the request body is larger than {limit} bytes (the server's --max-body-bytes); send a smaller body",
        param=None, code="request_too_large",
    )  # fmt: skip
    length = dict(scope["headers"]).get(b"content-length", b"")
    if length.strip().isdigit() and int(length) > limit:
        return too_big
    chunks: list[bytes] = []
    size = 0
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            return APIError(
                408, f"the request body did not arrive within {timeout:g} s (the server's --body-timeout); send "
                "it at once", param=None, code="request_timeout",
            )  # fmt: skip
        if message["type"] != "http.request":  # the client left: the app sees an empty body and its disconnect
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return too_big
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the connection's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
