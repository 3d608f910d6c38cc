"""Requests generated from the server's own OpenAPI schema by schemathesis (its CLI, as a user runs it), over
real loopback HTTP: no request, valid or not, may get a 5xx, a status the schema does not list, or a body or
content type that breaks the schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis  # noqa: F401 (a dev dependency: its CLI runs below; missing, the test fails)
from helpers.tiny import save_tiny_model

from quantkit.runtime.config import EngineConfig
from quantkit.server import ServeConfig, ServerThread, create_app

API_KEY = "secret-key"
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
    "response_headers_conformance,negative_data_rejection,missing_required_header,unsupported_method,ignored_auth"
)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> str:
    # A 64-token context bounds every generation a generated request can ask for.
    model: Path = save_tiny_model(tmp_path_factory.mktemp("schema") / "model", max_position_embeddings=64)
    config = ServeConfig(port=0, served_model_name="tiny", api_key=API_KEY, engine=EngineConfig(num_kv_blocks=64))
    with ServerThread(create_app(model, config)) as server:
        yield server.url


def test_schemathesis_finds_no_server_error_and_no_schema_violation(server_url, tmp_path):
    command = [
        str(Path(sys.executable).parent / "schemathesis"), "run", f"{server_url}/openapi.json",
        "-H", f"Authorization: Bearer {API_KEY}", "--checks", CHECKS, "--max-examples", "40",
        "--seed", "1", "--workers", "1", "--no-color", "--generation-database", "none",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "No issues found" in done.stdout, done.stdout[-3000:]
