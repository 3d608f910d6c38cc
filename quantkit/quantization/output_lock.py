"""One run per output: an exclusive ``flock`` on ``.<output>.lock`` beside the output, held for the whole run.

A second run on the same output is refused in one line naming the holder (pid, host, start time, command). The
kernel releases the lock when its holder dies, however it dies, so a run killed with ``kill -9`` leaves nothing that
blocks the next one; and while a run holds the lock, every temporary beside the output is known to be a dead run's
(:mod:`quantkit.quantization.leftovers`), with no guess from process ids (wrong across PID namespaces and NFS).

The lock file is removed by its holder on the way out. A run that opened it just before that removal then holds a
lock on a file that is no longer there; it notices (the path no longer names the file it locked) and takes the lock
again, so two runs never both hold one.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantkit.errors import QuantkitError

_HELD: dict[Path, int] = {}  # lock path -> how many times this process entered it (a recipe and its quantize)


class OutputBusy(QuantkitError):
    """Another run holds the output's lock."""


def lock_path(output: Path) -> Path:
    output = Path(output).absolute()
    return output.with_name(f".{output.name}.lock")


@contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold the output's lock for the duration; re-entrant within one process."""
    path = lock_path(output)
    if path in _HELD:
        _HELD[path] += 1
        try:
            yield
        finally:
            _HELD[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, Path(output))
    _HELD[path] = 1
    try:
        yield
    finally:
        del _HELD[path]
        path.unlink(missing_ok=True)  # while still locked: the next run creates a fresh file
        os.close(fd)  # releases the lock


def _acquire(path: Path, output: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputBusy(
                f"output '{output}' is being written by another quantkit run ({holder}); wait for it to finish, "
                "or write to another output"
            ) from None
        if _names_this_file(path, fd):
            _record_holder(fd)
            return fd
        os.close(fd)  # locked a file its holder removed on the way out: take the lock on the new one


def _names_this_file(path: Path, fd: int) -> bool:
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _record_holder(fd: int) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["quantkit", *sys.argv[1:3]]),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "it is starting"
    return f"pid {info.get('pid')} on {info.get('host')}, since {info.get('started')}: {info.get('command')}"
