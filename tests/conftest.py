"""Shared fixtures: a tiny random Llama with a word-level tokenizer (fast), and the real SmolLM2 (e2e)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.paths import REPO

# Converted models are cached under a directory the tests create, reused across runs.
os.environ.setdefault("QUANTKIT_CACHE", str(REPO / ".cache" / "quantkit"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run under the CPU interpreter when no GPU is present; the flag must be set before any test
# module imports triton (kernels check it when they are decorated), so before the helpers import transformers.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from helpers.tiny import save_tiny_model  # noqa: E402 (after the environment above)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_bos_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_bos") / "model", add_bos=True)


@pytest.fixture(scope="session")
def tiny_calib_file(tiny_model_dir, tmp_path_factory) -> Path:
    """4 x 32 calibration windows of real text for the tiny models (they share one tokenizer)."""
    from helpers.tiny import tiny_calibration

    return tiny_calibration(tiny_model_dir, tmp_path_factory.mktemp("tiny_calib"), 4)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, converted once into the test cache. Never skipped: CI must run e2e tests."""
    from quantkit.model.resolve import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture()
def text_corpus(tmp_path) -> Path:
    """A small local text file made of real calibration sentences."""
    import json

    lines = (REPO / "calibration" / "austen_calibration.jsonl").read_text().splitlines()[:6]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(json.loads(line)["text"] for line in lines))
    return path
