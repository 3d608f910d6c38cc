"""A failure planted in one rank, for the tests and the kill benchmark: ``QUANTKIT_DIST_FAULT=<rank>:<block>`` raises
in rank ``rank`` when it reaches block ``block``; ``<rank>:<block>:kill`` ends that process outright, as ``kill -9``
would. ``QUANTKIT_DIST_FAULT_STAMP=<file>`` writes the wall-clock time of the failure there first (the kill
benchmark measures how long the other ranks take to stop from it). Unset (always, outside the tests), it costs one
environment lookup per block."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

FAULT_ENV = "QUANTKIT_DIST_FAULT"


class InjectedFault(RuntimeError):
    """The planted failure."""


def maybe_fail(rank: int, block: int) -> None:
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    parts = wanted.split(":")
    if int(parts[0]) != rank or int(parts[1]) != block:
        return
    stamp = os.environ.get(FAULT_ENV + "_STAMP")
    if stamp:
        Path(stamp).write_text(repr(time.time()))
    if len(parts) > 2 and parts[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected failure at block {block}")
