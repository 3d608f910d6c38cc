"""`run_smoke` / `quantkit smoke`: a serving round trip checked against the offline engine."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_cli

from quantkit.runtime.llm import LLM
from quantkit.server.smoke import SmokeReport, run_smoke


def test_run_smoke_on_a_tiny_checkpoint_is_ok(tiny_model_dir):
    report = run_smoke(tiny_model_dir, ["the a of", "she was"], max_tokens=6)
    assert isinstance(report, SmokeReport)
    assert report.ok, report.failures
    assert report.failures == [] and report.requests == 10 and report.seconds > 0
    assert report.completion_tokens > 0 and report.tokens_per_s > 0 and report.latency_p50_s > 0
    data = report.to_dict()
    assert json.loads(json.dumps(data))["ok"] is True and set(data["outputs"]) == {
        "completion:the a of",
        "chat:the a of",
        "completion:she was",
        "chat:she was",
    }


@pytest.mark.slow
def test_smoke_reports_a_mismatch_and_the_cli_exits_nonzero(tiny_model_dir, monkeypatch, capsys, tmp_path):
    generate = LLM.generate

    def wrong(self, *args, **kwargs):
        outputs = generate(self, *args, **kwargs)
        outputs[0].text += " wrong"
        return outputs

    monkeypatch.setattr(LLM, "generate", wrong)
    report = run_smoke(tiny_model_dir, ["the a of"], max_tokens=4)
    assert not report.ok and len(report.failures) == 1 and "offline" in report.failures[0]
    code, _, err = run_cli(["smoke", str(tiny_model_dir), "--prompt", "she", "--max-tokens", "3"], capsys)
    assert code == 1 and "smoke failed" in err


@pytest.mark.slow
def test_smoke_cli_passes(tiny_model_dir, capsys, tmp_path):
    out_json = tmp_path / "smoke.json"
    code, out, err = run_cli(["smoke", str(tiny_model_dir), "--max-tokens", "4", "--json", str(out_json)], capsys)
    assert code == 0, err
    assert "smoke test passed" in out and json.loads(out_json.read_text())["ok"] is True
