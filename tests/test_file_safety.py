"""Files are never written through a planted link or read from outside their directory: temporary names are
exclusive and unpredictable, names read back from files (a work directory's state, a shard index) cannot leave the
directory, and a model's side files that are links must point inside the model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantkit import atomic
from quantkit.errors import QuantkitError
from quantkit.format.files import shard_files, side_files
from quantkit.quantization.workdir import STATE, WorkDir


def test_a_link_planted_at_the_old_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "state.json"
    (tmp_path / f".{target.name}.tmp-{os.getpid()}").symlink_to(victim)  # the name the writer used to take
    atomic.write_text(target, "new")
    assert target.read_text() == "new" and victim.read_text() == "keep"
    names = {atomic.exclusive_temp(target).name for _ in range(3)}
    assert len(names) == 3  # unpredictable: a fresh name each time


@pytest.mark.parametrize("name", ["../outside.pt", "/etc/passwd", "a/b.pt", ".."])
def test_a_work_directory_naming_a_file_outside_it_is_refused(tmp_path: Path, name: str) -> None:
    work = tmp_path / "out.partial"
    work.mkdir()
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"x")
    fingerprints = {"model": "m"}
    state = {"fingerprints": fingerprints, "finished": 1, "hidden": name, "records": []}
    (work / STATE).write_text(json.dumps(state))
    with pytest.raises(QuantkitError, match="would leave the directory"):
        WorkDir.open(work, fingerprints, resume=True, discard=False).load_hidden()
    assert outside.read_bytes() == b"x"


def test_a_shard_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(1)}, str(tmp_path / "evil.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../evil.safetensors"}}))
    with pytest.raises(QuantkitError, match="would leave the directory"):
        shard_files(model)


def test_side_file_links_must_point_inside_the_model(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(QuantkitError, match="outside the model"):
        side_files(model)
    # a Hugging Face cache snapshot links its files to the repository's blobs/: those are inside the model
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(repo / "blobs" / "abc")
    assert [f.name for f in side_files(snapshot)] == ["tokenizer.json"]


def test_plan_and_measurement_files_are_flushed_before_the_rename(tmp_path: Path, monkeypatch) -> None:
    from quantkit.mixed.measurement import CandidateCost, Measurement, UnitMeasurement, save_measurement

    flushed: list[int] = []
    real = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (flushed.append(fd), real(fd))[1])
    unit = UnitMeasurement(
        "model.layers.0.mlp.down_proj", ["model.layers.0.mlp.down_proj"], 64, {"int8": CandidateCost(0.1, 544)}
    )
    measurement = Measurement(model="m", mode="proxy", candidates=["int8"], units=[unit], metadata={})
    save_measurement(measurement, tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text())["model"] == "m"
    assert len(flushed) >= 2  # the file, then its directory
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
    from quantkit.mixed.plan_file import PlanRule, PlanRules, save_plan

    flushed.clear()
    save_plan(PlanRules(model="m", rules=[PlanRule("model.layers.0.mlp.down_proj", "int8")]), tmp_path / "p.yaml")
    assert len(flushed) >= 2 and sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "p.yaml"]
