"""End to end on the real SmolLM2: the official openai client against `quantkit serve`, and the smoke test."""

from __future__ import annotations

import openai
import pytest

from quantkit.runtime.config import EngineConfig
from quantkit.server import ServeConfig, ServerThread, create_app
from quantkit.server.smoke import run_smoke

pytestmark = pytest.mark.e2e


def test_openai_client_and_smoke_on_smollm2(smollm2_dir):
    app = create_app(
        smollm2_dir, ServeConfig(port=0, served_model_name="smollm2", engine=EngineConfig(max_model_len=512))
    )
    with ServerThread(app) as srv:
        api = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        done = api.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert "Paris" in done.choices[0].text
        chat = api.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content.strip()
    del app, srv
    report = run_smoke(smollm2_dir, max_tokens=8)
    assert report.ok, report.failures
