"""FastAPI's errors as OpenAI error objects: validation errors are 400 (never 422), naming the field at fault."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from quantkit.server.protocol import APIError


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), exc.status)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
    if first.get("type") == "json_invalid":
        return JSONResponse(APIError(400, f"malformed JSON body: {first.get('msg', '')}").body(), 400)
    param = ".".join(loc) or None
    return JSONResponse(APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param).body(), 400)


def _union_tag(part: str | int) -> bool:
    """Pydantic's name for the member of a union that failed ("constrained-str", "list[int]"): not a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in {"str", "int", "float", "bool", "list"})


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = APIError(exc.status_code, str(exc.detail), kind).body()
    return JSONResponse(body, exc.status_code, headers=exc.headers)  # a 405 keeps its Allow header
