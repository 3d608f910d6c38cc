"""Quantizing never holds the whole model: a synthetic model is quantized in a subprocess whose memory
growth above its own import baseline stays far below the model's size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny import build_word_tokenizer
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _write_synthetic_model(path: Path) -> int:
    """bf16 random weights, one shard per layer (never all in memory here either); returns bytes written."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    build_word_tokenizer().save_pretrained(path)
    h, inter, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], 4 * (CONFIG["hidden_size"] // 16)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    shards = [
        {"model.embed_tokens.weight": rand(CONFIG["vocab_size"], h), "model.norm.weight": torch.ones(h).bfloat16()}
    ]
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
                p + "input_layernorm.weight": torch.ones(h).bfloat16(),
                p + "post_attention_layernorm.weight": torch.ones(h).bfloat16(),
            }
        )
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


BASELINE = """
import torch, transformers
from transformers.models.llama import modeling_llama
import quantkit.quantization.pipeline, quantkit.data.calibration
from quantkit.memory import peak_rss_mb
print(peak_rss_mb())
"""


@pytest.mark.slow
def test_quantizing_needs_far_less_memory_than_the_model(tmp_path):
    model_bytes = _write_synthetic_model(tmp_path / "model")
    assert model_bytes > 350e6
    baseline_mb = float(
        subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, check=True).stdout.split()[-1]
    )
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "quantkit",
        "quantize",
        str(tmp_path / "model"),
        "-o",
        str(tmp_path / "out"),
        "--method",
        "rtn",
        "--num-samples",
        "2",
        "--seq-len",
        "64",
        "--max-shard-size",
        "32",
        "--json",
        str(summary),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    peak_mb = json.loads(summary.read_text())["peak_rss_mb"]
    growth_mb = peak_mb - baseline_mb
    print(f"model {model_bytes / 1e6:.0f} MB, baseline {baseline_mb:.0f} MB, peak {peak_mb:.0f} MB")
    assert growth_mb < 0.5 * model_bytes / 2**20, (baseline_mb, peak_mb)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # sharded at 32 MB


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_peak_rss_of_a_subprocess_is_its_own_not_its_parents():
    """ru_maxrss of a forked + exec'd child starts at the parent's peak; the reported peak must not."""
    ballast = torch.ones(400 * 2**20 // 4)  # 400 MB touched in this (parent) process
    code = "from quantkit.memory import peak_rss_mb; print(peak_rss_mb())"
    child_mb = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 5 < child_mb < 200, child_mb  # the interpreter and quantkit.memory, not the 400 MB ballast
    assert float(ballast[-1]) == 1.0


def _probe(code: str, mode: str) -> float:
    """The number a probe script prints, run in a fresh interpreter (a process-wide malloc policy)."""
    return float(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True).stdout)


HEAP_PROBE = """
import sys, torch
from quantkit.memory import map_large_allocations
if sys.argv[1] == "mapped":
    map_large_allocations()
def anon_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) / 1024
big = torch.ones(24 << 18); del big  # freeing a mapped 24 MB block raises glibc's mmap threshold to 24 MB
before = anon_mb()
x = torch.ones(16 << 18); del x  # 16 MB, written and freed
print(anon_mb() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RssAnon is Linux's")
def test_large_allocations_are_returned_to_the_os_when_freed():
    """With glibc's defaults a freed 16 MB tensor stays resident (heap) until a trim; mapped, it is gone at once."""
    kept = {mode: _probe(HEAP_PROBE, mode) for mode in ("default", "mapped")}
    assert kept["mapped"] < 2 < 12 < kept["default"], kept


FAULT_PROBE = """
import resource, sys, torch
from quantkit.memory import keep_freed_memory_for_reuse
if sys.argv[1] == "serving":
    keep_freed_memory_for_reuse()
for _ in range(10):  # a few steps' temporaries first: the heap grows to hold them
    torch.ones(40 << 18), torch.ones(24 << 18)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(40 << 18)  # 40 MB written and freed, as a decode step's temporaries are, again and again
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="glibc's malloc is Linux's")
def test_the_serving_policy_reuses_freed_memory_without_page_faults():
    """glibc maps a 40 MB tensor afresh each time (10,240 page faults); the serving policy reuses the heap."""
    faults = {mode: _probe(FAULT_PROBE, mode) for mode in ("default", "serving")}
    assert faults["serving"] < 500 < 5000 < faults["default"], faults
