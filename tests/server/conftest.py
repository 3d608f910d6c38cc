"""Every test here runs tiny models on one torch thread (see helpers.threads)."""

from __future__ import annotations

import pytest
from helpers.threads import torch_threads


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield
