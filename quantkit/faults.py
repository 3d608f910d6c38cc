"""Named commit points where the fault-injection tests kill the process, as ``kill -9`` would.

``QUANTKIT_FAULT=<point>`` kills at the first time the point is reached, ``<point>@N`` at the N-th time (1-based).
``QUANTKIT_STALL=<point>=<file>`` holds the run at the point's first pass while ``<file>`` exists (it first writes
``<file>.reached``), so a test can act while a run is known to be in the middle of its work.
Unset (always, outside the tests), a commit point costs two environment lookups.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

POINTS = (
    "block-written",  # a finished block's tensors renamed into the work directory
    "outer-written",  # with rotation: the rotated embedding and head renamed into the work directory
    "hidden-written",  # the next block's input renamed into the work directory
    "reference-written",  # with tuning: the float model's input to the next block renamed into place
    "state-written",  # state.json naming them renamed into place
    "checkpoint-staged",  # the checkpoint complete under its temporary name, not yet renamed
    "checkpoint-written",  # the checkpoint directory renamed into place
    "work-dir-retired",  # the work directory renamed away for removal
)
_reached: Counter[str] = Counter()


def commit_point(name: str) -> None:
    """Die here, without cleanup, when ``QUANTKIT_FAULT`` names this point (and, with ``@N``, its N-th pass); wait
    here while ``QUANTKIT_STALL``'s file exists when it names this point."""
    stall = os.environ.get("QUANTKIT_STALL")
    if stall and stall.partition("=")[0] == name and not _reached[f"stall:{name}"]:
        _reached[f"stall:{name}"] += 1
        gate = Path(stall.partition("=")[2])
        gate.with_name(gate.name + ".reached").touch()
        while gate.exists():
            time.sleep(0.02)
    wanted = os.environ.get("QUANTKIT_FAULT")
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != name:
        return
    _reached[name] += 1
    if _reached[name] == int(nth or 1):
        os._exit(137)
