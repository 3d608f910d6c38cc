"""Files written so that a crash, a kill or a full disk never leaves a partial file under the final name: the
data goes to a temporary name in the same directory, is flushed to disk, then renamed over the target.

The temporary name is unpredictable and created exclusively without following a link (``O_EXCL | O_NOFOLLOW``),
so nothing planted beside the target can redirect the write; names read back from files (a work directory's
state, a shard index) go through :func:`inside`, which refuses one that would leave its directory."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError

_NEARLY_FULL = 16 << 20  # bytes: a write that failed with less free space than this failed for want of space
_NO_SPACE = ("no space left on device", "os error 28")


def disk_full(exc: BaseException, path: Path) -> OSError | None:
    """``exc`` as an ENOSPC OSError naming ``path`` when a full disk caused it: writers report it in their own
    words (safetensors: "No space left on device (os error 28)"; torch.save: "unexpected pos")."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return exc
    if not isinstance(exc, (OSError, RuntimeError)) and type(exc).__name__ != "SafetensorError":
        return None
    said = any(words in str(exc).lower() for words in _NO_SPACE)
    try:
        nearly_full = shutil.disk_usage(Path(path).parent).free < _NEARLY_FULL
    except OSError:
        nearly_full = False
    return OSError(errno.ENOSPC, "No space left on device", str(path)) if said or nearly_full else None


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, fsync it, then rename it to ``path``; a full disk,
    however the writer reports it, raises an ENOSPC OSError naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = exclusive_temp(path)
    try:
        try:
            write(tmp)
        except Exception as exc:
            full = disk_full(exc, path)
            if full is None or full is exc:
                raise
            raise full from exc
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        tmp.replace(path)
        _fsync_dir(path.parent)  # the rename itself survives a power loss
    finally:
        tmp.unlink(missing_ok=True)


def exclusive_temp(path: Path) -> Path:
    """A new empty file beside ``path`` under an unpredictable name, created by this call alone (never a link)."""
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        except FileExistsError:
            continue
        return tmp


def inside(directory: Path, name: str, what: str = "file") -> Path:
    """``directory / name`` for a plain name read from a file; a name that would leave the directory (absolute,
    with a separator, ``..``) is refused in one line, as a damaged or crafted file."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise QuantkitError(
            f"{what} name {name!r} in {directory} would leave the directory; the file naming it is damaged or crafted"
        )
    return Path(directory) / name


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, data: Any, *, indent: int = 2) -> None:
    """``data`` as indented JSON with a final newline."""
    write_text(path, json.dumps(data, indent=indent) + "\n")


def fsync_tree(path: Path) -> None:
    """Flush a file, or every file under a directory and the directories themselves, to disk."""
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        return
    inside = sorted(path.rglob("*"))
    for file in (p for p in inside if p.is_file()):
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    for directory in [path, *(p for p in inside if p.is_dir())]:
        _fsync_dir(directory)


def publish(tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Move a finished temporary file or directory to ``final``: flushed first, then renamed; an existing ``final``
    (only with ``overwrite``) is swapped out and deleted only once the new one is in place."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if final.exists() and not overwrite:
        raise FileExistsError(final)
    if not final.exists():
        tmp.rename(final)
    else:
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        remove_path(old)
        final.rename(old)
        try:
            tmp.rename(final)
        except OSError:
            old.rename(final)
            raise
        remove_path(old)
    _fsync_dir(final.parent)


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree, if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
