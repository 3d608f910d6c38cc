"""Files written so that a crash, a kill or a full disk never leaves a partial file under the final name: the
data goes to a temporary name in the same directory, is flushed to disk, then renamed over the target."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, fsync it, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, data: Any, *, indent: int = 2) -> None:
    """``data`` as indented JSON with a final newline."""
    write_text(path, json.dumps(data, indent=indent) + "\n")
