"""Where quantkit keeps converted models and reusable intermediate results."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$QUANTKIT_CACHE``, else ``~/.cache/quantkit``."""
    return Path(os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit").expanduser()
