"""Run the Triton kernels on CPU through the interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before triton is first imported, so this happens at conftest import time
(pytest imports conftest.py before the test modules that import the kernels).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
