"""``GET /health`` (no API key needed; 503 while draining, or while the engine thread is dead or its recent steps all
failed) and ``GET /v1/models`` (the one served model)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from quantkit.server.state import ServerState

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    problem = state.engine.health()
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, 503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "quantkit"}
    return {"object": "list", "data": [{**card, "max_model_len": state.max_model_len}]}
