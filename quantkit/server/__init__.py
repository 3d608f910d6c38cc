"""OpenAI-compatible HTTP serving for the bundled runtime (needs the ``serve`` extra: fastapi, uvicorn)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quantkit.server.config import ServeConfig

__all__ = ["ServeConfig", "ServerThread", "create_app", "serve"]

if TYPE_CHECKING:
    from quantkit.server.app import create_app
    from quantkit.server.runner import ServerThread, serve

_RUNNER = "quantkit.server.runner"
_LAZY = {"create_app": "quantkit.server.app", "ServerThread": _RUNNER, "serve": _RUNNER}


def __getattr__(name: str) -> Any:
    """Import fastapi / uvicorn only when the app is first used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quantkit.server' has no attribute {name!r}")
