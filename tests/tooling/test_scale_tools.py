"""The tools of the scale checks: random models in real shapes (also built by the GPU check) and running a command
under a RAM cap."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tools import memory_cap, random_model

# holds the memory for a second: the cap's poller must see it before the process exits
ALLOCATE = (
    "import time; x = bytearray({n}); x[::4096] = b'1' * len(x[::4096]); print('held', flush=True); time.sleep(1)"
)


@pytest.mark.slow
def test_a_random_model_has_the_preset_shapes_and_is_built_once(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = random_model.build_random_model(tmp_path / "m", "tiny", shard_mb=1)
    shape = random_model.PRESETS["tiny"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == random_model.parameter_count(shape)
    assert model.config.vocab_size == shape.vocab and model.config.tie_word_embeddings
    ids = AutoTokenizer.from_pretrained(out)("It is a truth universally acknowledged").input_ids
    assert len(ids) == 6 and max(ids) < shape.vocab and len(AutoTokenizer.from_pretrained(out)) == shape.vocab
    stamp = (out / "config.json").stat().st_mtime_ns
    random_model.build_random_model(tmp_path / "m", "tiny", shard_mb=1)
    assert (out / "config.json").stat().st_mtime_ns == stamp  # the same build is reused
    random_model.build_random_model(tmp_path / "m", "tiny", shard_mb=1, seed=1)
    assert (out / "config.json").stat().st_mtime_ns != stamp


def test_a_sharded_random_model_has_an_index(tmp_path: Path) -> None:
    shape = random_model.Shape(256, 3, 4, 2, 512, 1000, tied=False, rope_theta=10000.0)
    random_model.PRESETS["test-sharded"] = shape
    try:
        out = random_model.build_random_model(tmp_path / "m", "test-sharded", shard_mb=1)
    finally:
        del random_model.PRESETS["test-sharded"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(out.glob("model-*.safetensors"))) > 1
    assert index["metadata"]["total_size"] == random_model.parameter_count(shape) * 2
    assert "lm_head.weight" in index["weight_map"]


def test_a_random_model_can_keep_the_width_with_fewer_layers(tmp_path: Path) -> None:
    from dataclasses import replace

    from safetensors import safe_open

    out = random_model.build_random_model(tmp_path / "m", "tiny", layers=1, shard_mb=1)
    config = json.loads((out / "config.json").read_text())
    shape = random_model.PRESETS["tiny"]
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == shape.hidden
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        count = sum(math.prod(f.get_slice(n).get_shape()) for n in names)
    assert count == random_model.parameter_count(replace(shape, layers=1)) < random_model.parameter_count(shape)
    assert not any(n.startswith("model.layers.1.") for n in names)


def test_drawing_on_a_missing_gpu_is_one_clear_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="torch sees no CUDA device here; use --device cpu"):
        random_model.main(["tiny", str(tmp_path / "m"), "--device", "cuda"])


@pytest.mark.parametrize("use_cgroup", [False, True])
def test_a_command_over_the_cap_is_killed_and_one_under_it_is_measured(use_cgroup: bool) -> None:
    if use_cgroup:
        probe = memory_cap._Cgroup.create(1 << 30)
        if probe is None:
            pytest.skip("no writable memory cgroup here")
        probe.remove()
    command = [sys.executable, "-c", ALLOCATE.format(n=300_000_000)]
    over = memory_cap.run_capped(command, 150_000_000, use_cgroup=use_cgroup)
    assert over.killed_over_cap and over.returncode != 0
    lines: list[str] = []
    under = memory_cap.run_capped(command, 2_000_000_000, use_cgroup=use_cgroup, on_line=lines.append)
    assert under.returncode == 0 and not under.killed_over_cap and lines == ["held"]
    assert 300e6 < under.peak_anon_bytes <= under.peak_rss_bytes < 2e9 and under.enforcement.startswith(
        "cgroup" if use_cgroup else "watch"
    )
