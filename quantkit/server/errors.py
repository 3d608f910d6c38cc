"""FastAPI's errors as OpenAI error objects: validation errors are 400 (never 422), naming the field at fault; an
unexpected exception is a 500 naming a request id (its details go to the log, never to the client)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from quantkit.server.protocol import APIError, internal_error, invalid_unicode, new_id

_log = logging.getLogger("quantkit.server")
_FIX = "(the accepted values are in the request schema: GET /openapi.json)"


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), exc.status)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = _most_specific(errors)
    unicode = next((e for e in errors if e.get("type") == "string_unicode"), None)
    if unicode is not None:  # a lone UTF-16 surrogate ("\ud800") in a string field (pydantic refuses it)
        where = [str(p) for p in unicode.get("loc", ()) if p != "body" and not _union_tag(p)]
        return JSONResponse(invalid_unicode(".".join(where) or "body").body(), 400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
    if first.get("type") == "json_invalid":
        return JSONResponse(APIError(400, f"malformed JSON body: {first.get('msg', '')}; send valid JSON").body(), 400)
    param = ".".join(loc) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid')} {_FIX}"
    return JSONResponse(APIError(400, message, param=param).body(), 400)


# Errors that say a value has another type: in a union each member reports one, and the member matching the value's
# type (a list sent for `str | list[str]`) has the error worth showing (its list is too long).
_TYPE_ERRORS = {"string_type", "list_type", "int_type", "float_type", "bool_type", "dict_type", "model_type",
                "model_attributes_type", "int_parsing", "float_parsing", "bool_parsing"}  # fmt: skip


def _most_specific(errors: Sequence[Any]) -> dict[str, Any]:
    field = errors[0]["loc"][:2] if errors else ()
    same = [e for e in errors if e["loc"][:2] == field]
    return next((e for e in same if e.get("type") not in _TYPE_ERRORS), same[0] if same else {})


def _union_tag(part: str | int) -> bool:
    """Pydantic's name for the member of a union that failed ("constrained-str", "list[int]"): not a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in {"str", "int", "float", "bool", "list"})


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    where = f"{request.method} {request.url.path}"
    body = APIError(
        exc.status_code, f"{exc.detail}: {where}; the routes and methods are in GET /openapi.json", kind
    ).body()
    return JSONResponse(body, exc.status_code, headers=exc.headers)  # a 405 keeps its Allow header


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    rid = new_id("req")
    _log.error("unexpected error in request %s", rid, exc_info=exc)
    return JSONResponse(internal_error(rid).body(), 500)
