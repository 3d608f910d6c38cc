"""Streamed safetensors files are byte for byte what safetensors' own save_file writes, whether the tensors are in
memory or copied from another file's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.format import safetensors_stream
from quantkit.format.safetensors_stream import DTYPE_NAMES, stored_tensors, write_safetensors


def _mixed(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, dtype in enumerate(DTYPE_NAMES):
        for name in (f"model.layers.{i}.w", f"model.layers.{i + 10}.w"):
            values = torch.randn(3, 5, generator=gen) * 50
            tensors[name] = values > 0 if dtype == torch.bool else values.to(dtype)
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    return tensors


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None])
def test_in_memory_tensors_give_save_files_bytes(tmp_path: Path, metadata: dict | None) -> None:
    tensors = _mixed()
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_stored_tensors_are_copied_exactly_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safetensors_stream, "_CHUNK", 7)  # many short copies, none aligned to a tensor
    source = _mixed(seed=1)
    save_file(source, str(tmp_path / "source.safetensors"), metadata={"format": "pt"})
    stored = stored_tensors(tmp_path / "source.safetensors")
    assert list(stored) == sorted(source) and stored["scalar"].shape == () and stored["empty"].nbytes == 0
    extra = {"lm_head.weight": torch.randn(4, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)}
    write_safetensors(tmp_path / "ours.safetensors", {**stored, **extra}, {"format": "pt"})
    save_file({**source, **extra}, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in source.items())


def test_a_truncated_source_is_an_error(tmp_path: Path) -> None:
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "source.safetensors"))
    stored = stored_tensors(tmp_path / "source.safetensors")
    data = (tmp_path / "source.safetensors").read_bytes()
    (tmp_path / "source.safetensors").write_bytes(data[:-100])
    with pytest.raises(OSError, match="ends inside tensor data"):
        write_safetensors(tmp_path / "out.safetensors", stored)
