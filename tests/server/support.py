"""Helpers of the server tests: the tiny model's server config, waiting for a condition, raw-socket clients."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from quantkit.runtime.config import EngineConfig
from quantkit.server import ServeConfig, ServerThread

MODEL = "tiny"


def tiny_config(engine: dict | None = None, **server: Any) -> ServeConfig:
    return ServeConfig(
        port=0, served_model_name=MODEL, engine=EngineConfig(num_kv_blocks=256, **(engine or {})), **server
    )


def wait_for(cond: Callable[[], object], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def idle(srv: ServerThread) -> bool:
    """No request in flight, none in the engine, every KV block free."""
    eng = srv.state.engine
    bm = eng.engine.block_manager
    return eng.num_in_flight == 0 and not eng.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def metric(text: str, name: str) -> float:
    """The value of the first sample of ``name`` (labels included in ``name`` if given) in a /metrics text."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def connect(server: ServerThread | str, rcvbuf: int | None = None) -> socket.socket:
    """A plain socket to a server (a ServerThread or its URL), with a small receive buffer if asked."""
    url = urlparse(server if isinstance(server, str) else server.url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((url.hostname, url.port))
    return sock


def raw_request(server: ServerThread | str, body: dict[str, Any], rcvbuf: int | None = 4096,
                path: str = "/v1/completions", headers: dict[str, str] | None = None) -> socket.socket:  # fmt: skip
    """A POST sent on a plain socket (with a small receive buffer), nothing read: a client that never reads."""
    sock = connect(server, rcvbuf)
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes (or ``timeout``); a reset counts as the end."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, TimeoutError, OSError):
        pass
    return b"".join(chunks)


def start_cli_server(model: Path, extra: list[str], timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`quantkit serve` in a process of its own (one torch thread), and its URL once it serves."""
    cmd = [sys.executable, "-m", "quantkit", "serve", str(model), "--port", "0", "--served-model-name", MODEL, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if match := re.search(r"at (http://\S+)", line):
                found.append(match.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        raise AssertionError("the server did not start")
    return proc, found[0]
