"""The runtime serves every compressed-tensors preset's checkpoint as the format loader runs it
(:func:`quantkit.format.loader.load_quantized_model`, the reference): weights dequantized once, every quantized
linear's input quantized as the serving kernel does, and with a checkpoint's ``kv_cache_scheme`` the KV cache in FP8
under its stored per-layer or per-head scales.

Checkpoints come from the real pipeline (RTN, calibrated static input and KV scales) on a tiny Llama, all built once.
In float32 the runtime's logits equal the loader's to ``ATOL``: both dequantize and quantize inputs with the same
functions, so only the summation order of the (fused) matmuls and attention differs; greedy tokens are identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runtime import engine_logits, greedy, hf_logits

from quantkit.errors import QuantkitError
from quantkit.format.loader import load_quantized_model
from quantkit.format.presets import PRESETS
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import JobSteps, parse_method, resolve_scheme
from quantkit.quantization.pipeline import quantize_model
from quantkit.runtime.engine import Engine, RequestOutput
from quantkit.runtime.linear import Linear

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 71]
NEW_TOKENS = 10
# logits are O(1); a summation-order difference is O(1e-7), one flipped activation rounding O(1e-3)
ATOL = 1e-5
KV_CASES = {"fp8": "FP8_DYNAMIC", "fp8-head": "NVFP4"}  # kv cache scheme -> the preset it is written with


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from helpers.tiny import save_tiny_model

    # in-features 128 and 256: every preset's groups (16, 32, 128) and FP8_BLOCK's 128 x 128 tiles divide them
    return save_tiny_model(tmp_path_factory.mktemp("float_presets") / "model", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def checkpoints(model_dir: Path, tiny_calib_file: Path, tmp_path_factory) -> dict[str, Path]:
    """Every preset's checkpoint (by preset name) and the KV cases (by kv cache scheme name)."""
    root = tmp_path_factory.mktemp("float_preset_checkpoints")
    jobs = [(name, name, None) for name in PRESETS] + [(kv, preset, kv) for kv, preset in KV_CASES.items()]
    out = {}
    for key, preset, kv in jobs:
        steps = parse_method("rtn")
        scheme = resolve_scheme(JobSteps(steps).scheme_defaults(), PRESETS[preset])
        config = QuantizeConfig(
            solvers=steps, scheme=scheme, calibration_file=tiny_calib_file, kv_cache_scheme=kv, show_progress=False
        )
        quantize_model(model_dir, config, root / key)
        out[key] = root / key
    return out


def _engine(path: Path, **kw) -> Engine:
    return Engine(path, num_kv_blocks=64, block_size=4, max_model_len=128, **kw)


def _finish(engine: Engine, prompt: list[int]) -> RequestOutput:
    engine.add_request(prompt, greedy(NEW_TOKENS))
    finished: list[RequestOutput] = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    return finished[0]


def _generate(engine: Engine, prompt: list[int]) -> list[int]:
    return _finish(engine, prompt).token_ids


def _reference_generate(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _assert_serves_as_loader(path: Path, **engine_options) -> Engine:
    reference = load_quantized_model(path, dtype=torch.float32)
    engine = _engine(path, **engine_options)
    ours, theirs = engine_logits(engine, PROMPT), hf_logits(reference, PROMPT)
    assert float((ours - theirs).abs().max()) <= ATOL
    assert _generate(engine, PROMPT) == _reference_generate(reference, PROMPT)
    return engine


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_serves_as_the_loader_runs_it(checkpoints, preset: str) -> None:
    engine = _assert_serves_as_loader(checkpoints[preset])
    linears = [m for m in engine.model.modules() if isinstance(m, Linear) and m is not engine.model.lm_head]
    assert all(m.is_dense for m in linears)  # dequantized once at load (the torch backend)
    quantizes_inputs = PRESETS[preset].activations is not None
    assert all((m.input_quant is not None) == quantizes_inputs for m in linears)
    assert not engine.runner.cache.quantized  # no kv_cache_scheme: the cache keeps the compute dtype


@pytest.mark.parametrize("preset", [name for name, scheme in PRESETS.items() if scheme.activations is not None])
def test_input_quantization_changes_the_logits(checkpoints, preset: str) -> None:
    """The comparison above is not vacuous: with every input left in float32 the logits move."""
    engine = _engine(checkpoints[preset], enable_prefix_caching=False)  # the prompt runs twice
    quantized = engine_logits(engine, PROMPT)
    for module in engine.model.modules():
        if isinstance(module, Linear):
            module.input_quant = None
        for fused in ("qkv", "gate_up"):
            if getattr(module, fused, None) is not None:
                getattr(module, fused).input_quant = None
    assert float((engine_logits(engine, PROMPT) - quantized).abs().max()) > 100 * ATOL


@pytest.mark.parametrize("kv", list(KV_CASES))
def test_fp8_kv_cache_serves_under_the_stored_scales(checkpoints, kv: str) -> None:
    engine = _assert_serves_as_loader(checkpoints[kv])
    cache, cfg = engine.runner.cache, engine.model.config
    assert cache.values.dtype == torch.float8_e4m3fn and cache.scales is None  # no per-row scales
    assert cache.bytes_per_block == 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim  # 1 byte a value
    stored = cache.stored_scales
    assert stored is not None and tuple(stored.shape) == (2, cfg.num_layers, cfg.num_kv_heads)
    per_head_differs = bool((stored[..., 0] != stored[..., 1]).any())
    assert per_head_differs == (kv == "fp8-head")
    attention = engine.model.model.layers[1].self_attn
    assert torch.equal(stored[0, 1], attention.k_scale.float().reshape(-1).expand(cfg.num_kv_heads))
    # the cache's FP8 rounding is applied: the same weights with a float cache give other logits
    without_kv = engine_logits(_engine(checkpoints[KV_CASES[kv]]), PROMPT)
    assert float((engine_logits(_engine(checkpoints[kv]), PROMPT) - without_kv).abs().max()) > 100 * ATOL


def test_fp8_kv_cache_is_the_same_through_prefix_cache_and_chunked_prefill(checkpoints) -> None:
    path = checkpoints["fp8-head"]
    prefix = [1, 9, 10, 11, 12, 13, 14, 15, 16]  # two full blocks of 4 shared
    prompt = [*prefix, 40, 41]
    whole = _generate(_engine(path, enable_prefix_caching=False), prompt)
    cached = _engine(path)
    _generate(cached, [*prefix, 50])
    hit = _finish(cached, prompt)
    assert hit.num_cached_tokens >= 8 and hit.token_ids == whole
    chunked = _engine(path, enable_chunked_prefill=True, max_num_batched_tokens=4)
    assert _generate(chunked, prompt) == whole


def test_explicit_fp8_uses_the_stored_scales_and_int8_is_refused(checkpoints) -> None:
    path = checkpoints["fp8"]
    auto, fp8 = _engine(path), _engine(path, kv_cache_dtype="fp8")
    assert fp8.runner.cache.stored_scales is not None
    assert torch.equal(engine_logits(auto, PROMPT), engine_logits(fp8, PROMPT))
    with pytest.raises(QuantkitError, match=r"kv_cache_dtype='int8' would discard its scales; use .*'auto' or 'fp8'"):
        _engine(path, kv_cache_dtype="int8")
