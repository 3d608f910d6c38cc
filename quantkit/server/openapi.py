"""The OpenAPI document says what the server really does: request errors are 400 with an error object (documented
per route), never FastAPI's 422; ``model`` must be the served name; no request may ask for more tokens than the
context holds; a 200 is JSON, or server-sent events with ``stream: true``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quantkit.server.protocol import ErrorResponse

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")

_ERROR = {"model": ErrorResponse}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "Bad request: malformed JSON, a wrong type, a value out of range, invalid "
          "Unicode, an unknown model, or a prompt that does not fit the context."},
    401: {**_ERROR, "description": "Missing or wrong API key."},
    408: {**_ERROR, "description": "The request head or body did not arrive within the server's --header-timeout "
          "or --body-timeout."},
    413: {**_ERROR, "description": "The request body is larger than the server's --max-body-bytes."},
    429: {**_ERROR, "description": "The server queue is full (or the request made room for an API key holding "
          "fewer requests); retry later."},
    500: {**_ERROR, "description": "The server failed on the request; the message names the request id to look up "
          "in the server log."},
    503: {**_ERROR, "description": "The server is shutting down, its engine is not running, or it has too many "
          "open connections."},
}  # fmt: skip

# One server-sent event: `data:` holds a JSON chunk, or [DONE] last.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def openapi_document(
    openapi: Callable[[], dict[str, Any]], model_name: str, max_model_len: int
) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema function ``openapi``, patched as the module docstring says."""

    def schema() -> dict[str, Any]:
        doc = openapi()
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for name in ("CompletionRequest", "ChatRequest"):
            properties = components.get(name, {}).get("properties", {})
            if "model" in properties:
                properties["model"]["enum"] = [model_name]
            for limit in ("max_tokens", "max_completion_tokens"):
                for option in properties.get(limit, {}).get("anyOf", []):
                    if option.get("type") == "integer":
                        option["maximum"] = max_model_len
        for route in GENERATION_ROUTES:
            ok = doc.get("paths", {}).get(route, {}).get("post", {}).get("responses", {}).get("200", {})
            ok.setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
        return doc

    return schema
