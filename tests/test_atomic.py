"""A full disk, however a writer reports it, becomes one ENOSPC OSError naming the file; nothing is left behind."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest

from quantkit import atomic

Usage = namedtuple("Usage", "total used free")


def _failing(exc: BaseException):
    def write(tmp):
        tmp.write_bytes(b"partial")
        raise exc

    return write


def test_safetensors_words_become_enospc(tmp_path):
    error = type("SafetensorError", (Exception,), {})("I/O error: No space left on device (os error 28)")
    with pytest.raises(OSError) as info:
        atomic.write_atomically(tmp_path / "a.safetensors", _failing(error))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "a.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_torch_save_unexpected_pos_on_a_nearly_full_disk_becomes_enospc(tmp_path, monkeypatch):
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(100, 100, 0))
    with pytest.raises(OSError) as info:
        atomic.write_atomically(tmp_path / "h.pt", _failing(error))
    assert info.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_other_errors_pass_through(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(100, 0, 10**12))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        atomic.write_atomically(tmp_path / "h.pt", _failing(RuntimeError("unexpected pos 1 vs 2")))
    with pytest.raises(ValueError, match="bad"):
        atomic.write_atomically(tmp_path / "h.pt", _failing(ValueError("bad")))
