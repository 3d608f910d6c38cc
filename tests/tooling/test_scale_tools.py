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


def _stored_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            shapes |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
    return shapes


def test_a_random_moe_model_is_stored_per_expert_as_transformers_saves_it(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.model.resolve import arch_for_dir

    shape = random_model.PRESETS["tiny-moe"]
    assert shape.experts is not None and shape.attention_dim != shape.hidden // shape.heads  # head_dim as Qwen3's
    out = random_model.build_random_model(tmp_path / "m", "tiny-moe", shard_mb=1)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["head_dim"] == shape.attention_dim
    assert config["num_experts_per_tok"] == shape.experts.top_k and config["norm_topk_prob"] is True
    # transformers' own model of this config, saved: the same tensors under the same names and shapes
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    reference.save_pretrained(tmp_path / "reference")
    stored = _stored_shapes(out)
    assert stored == _stored_shapes(tmp_path / "reference")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored and "lm_head.weight" in stored
    assert sum(math.prod(s) for s in stored.values()) == random_model.parameter_count(shape)
    assert arch_for_dir(out).num_experts == shape.experts.count  # quantkit reads it as a mixture of experts


def test_the_qwen3_moe_preset_has_the_real_models_layer_shapes_in_1_to_2b_parameters() -> None:
    shape = random_model.PRESETS["qwen3-30b-a3b-e16"]
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.attention_dim, shape.vocab) == (2048, 32, 4, 128, 151936)
    assert shape.experts is not None and (shape.experts.intermediate, shape.experts.top_k) == (768, 8)
    assert not shape.tied and shape.rope_theta == 1e6
    params = random_model.parameter_count(shape)
    layer = sum(math.prod(s) for n, s in random_model.tensor_shapes(shape) if n.startswith("model.layers.0."))
    assert 1e9 < params < 2e9
    assert layer * 4 < 0.6 * params * 2 / 2  # one block in float32 takes under half the cap (60% of bf16)


def test_the_scale_table_records_a_loader_that_fails_as_not_loadable(tmp_path: Path, monkeypatch) -> None:
    from benchmarks import record as record_module
    from benchmarks import scale_record

    monkeypatch.setattr(record_module, "RESULTS", tmp_path)
    run = {
        "method": "gptq",
        "ok": True,
        "killed_over_cap": False,
        "enforcement": "watchdog",
        "wall_s": 30.0,
        "block_seconds": [12.0, 9.0, 10.0],
        "peak_rss_mb": 900.0,
        "peak_anon_mb": 800.0,
        "cgroup_peak_mb": None,
        "checkpoint_mb": 1.0,
        "load": {"quantkit_finite": True, "transformers_finite": False, "transformers_error": "KeyError: 'experts'"},
    }
    model = {"preset": "tiny-moe", "layers": 2, "parameters": 723840, "bf16_mb": 1.45, "shards": 1}
    summary = {"model": model, "runs": [run], "cap_mb": 1000.0, "cap_fraction": 0.6, "scheme": "W4 g64 sym"}
    summary |= {"calibration": "4 x 64", "command": "python -m benchmarks.bench_scale --preset tiny-moe"}
    path = scale_record.record("scale_test", summary, random_model.PRESETS["tiny-moe"], shard_mb=1)
    table = json.loads(path.read_text())
    (row,) = table["rows"]
    assert row[:3] == ["GPTQ (act-order, static groups, MSE clip)", "30", "9.5"]
    assert row[-1] == "quantkit; not loadable in transformers (KeyError)"
    assert "8 experts of intermediate 64 per layer, top-2 routing" in table["protocol"]
    assert table["command"] == summary["command"] and any("12.0, 9.0, 10.0" in n for n in table["notes"])
