"""Float candidates (nvfp4, mxfp4, mxfp8, fp8): names <-> the presets' weight-only schemes, exact storage bits, the
unit solve on the float grids (one NVFP4 global scale per fused unit) and a plan that picks a float candidate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers.tiny import rtn_for_tests

from quantkit.errors import QuantkitError
from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.layouts import layout_for
from quantkit.format.presets import PRESETS
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter
from quantkit.mixed.candidates import FLOAT_CANDIDATES, candidate_name, parse_candidate, storage_bits
from quantkit.mixed.measurement import CandidateCost, Measurement, UnitMeasurement
from quantkit.mixed.plan_file import load_plan, save_plan
from quantkit.mixed.planner import plan
from quantkit.mixed.unit_error import solve_unit
from quantkit.quantization.methods.composition import parse_method
from quantkit.quantization.solvers.gptq import gptq_solve
from quantkit.quantization.solvers.grid import global_scale_of

GPTQ = parse_method("gptq")[0]  # the settings `quantize --method gptq` and `sensitivity` solve with
FORMATS = {
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
    "mxfp8": "mxfp8-quantized",
    "fp8": "naive-quantized",
}


@pytest.mark.parametrize("name", list(FLOAT_CANDIDATES))
def test_float_names_are_the_presets_weights_without_activations(name: str) -> None:
    scheme = parse_candidate(name)
    assert scheme is not None and scheme.is_float and scheme.activations is None
    assert scheme == dataclasses.replace(PRESETS[FLOAT_CANDIDATES[name]], activations=None)
    assert candidate_name(scheme) == name and parse_candidate(name.upper()) == scheme
    assert layout_for(scheme).format == FORMATS[name]


def test_float_layouts_as_compressed_tensors_defines_them() -> None:
    nv, mx4, mx8, fp8 = (parse_candidate(n) for n in ("nvfp4", "mxfp4", "mxfp8", "fp8"))
    assert (nv.bits, nv.group_size, nv.scale_format, nv.strategy) == (4, 16, "fp8", "tensor_group")
    assert (mx4.bits, mx4.group_size, mx4.scale_format) == (4, 32, "e8m0")
    assert (mx8.bits, mx8.group_size, mx8.scale_format) == (8, 32, "e8m0")
    assert (fp8.bits, fp8.strategy) == (8, "channel")  # FP8_DYNAMIC's weights, not FP8's per-tensor ones
    assert parse_candidate("nvfp4") == PRESETS["NVFP4A16"]  # the A16 preset is the same storage


@pytest.mark.parametrize(("typo", "meant"), [("nvfp8", "nvfp4"), ("mxpf4", "mxfp4"), ("fp-8", "fp8")])
def test_float_typos_suggest_the_name(typo: str, meant: str) -> None:
    with pytest.raises(
        QuantkitError, match=rf"unknown candidate '{typo}'; use int<bits>.*nvfp4.*; did you mean '{meant}'\?$"
    ):
        parse_candidate(typo)


def test_candidates_with_activations_are_not_candidates() -> None:
    with pytest.raises(QuantkitError, match="weight-only"):
        candidate_name(PRESETS["NVFP4"])
    with pytest.raises(QuantkitError, match="weight-only"):
        candidate_name(PRESETS["FP8"])  # per-tensor FP8 weights: no candidate stores them


def test_a_plan_file_typo_suggests_the_float_name(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("rules:\n- target: re:.*\n  scheme: nvpf4\n")
    with pytest.raises(QuantkitError, match=r"plan.yaml:3: .*unknown scheme 'nvpf4'; did you mean 'nvfp4'\?"):
        load_plan(path)


# hand counts of one [64, 128] Linear (bf16 scales where the scale takes the model's dtype)
HAND_BITS = {
    "nvfp4": 64 * 128 * 4 + 64 * (128 // 16) * 8 + 32,  # FP4 codes, FP8 scale per 16, float32 global scale
    "mxfp4": 64 * 128 * 4 + 64 * (128 // 32) * 8,  # FP4 codes, E8M0 scale per 32
    "mxfp8": 64 * 128 * 8 + 64 * (128 // 32) * 8,  # FP8 codes, E8M0 scale per 32
    "fp8": 64 * 128 * 8 + 64 * 16,  # FP8 codes, a bf16 scale per output row
}


@pytest.mark.parametrize("name", list(FLOAT_CANDIDATES))
def test_storage_bits_are_the_hand_count_and_what_inspect_counts(tmp_path: Path, name: str) -> None:
    scheme = parse_candidate(name)
    assert storage_bits(scheme, 64, 128) == HAND_BITS[name]
    qw = rtn_for_tests(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)), scheme)
    with ShardedWriter(tmp_path / "ckpt") as writer:
        writer.add(linear_tensors("layer.proj", qw, torch.bfloat16))
        writer.finalize({}, [], quantization_config=build_quantization_config([(scheme, ["Linear"])], []))
    (layer,) = inspect_checkpoint(tmp_path / "ckpt").layers
    assert layer.bytes * 8 == HAND_BITS[name]
    assert round(layer.bits_per_weight * 64 * 128) == HAND_BITS[name]


def _hessian(k: int, seed: int) -> torch.Tensor:
    x = torch.randn(4 * k, k, generator=torch.Generator().manual_seed(seed))
    return 2 * x.T @ x / x.shape[0]


def test_a_fused_unit_shares_one_nvfp4_global_scale() -> None:
    """q/k/v solved as one matrix: one global scale for the projection vLLM builds from them (it serves one per
    fused layer), the one of the stacked weights; solving them apart would give three."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 64, generator=gen) * s for n, s in ((64, 1.0), (32, 3.0), (32, 0.5))]
    parts = solve_unit(weights, _hessian(64, 1), parse_candidate("nvfp4"), GPTQ, torch.bfloat16, "qkv")
    shared = global_scale_of(torch.cat(weights), parse_candidate("nvfp4"))
    assert all(torch.equal(p.global_scale, shared) for p in parts)
    alone = [global_scale_of(w, parse_candidate("nvfp4")) for w in weights]
    assert len({float(g) for g in alone}) == 3  # the case would catch per-linear scales
    assert [p.shape for p in parts] == [(64, 64), (32, 64), (32, 64)]
    for p in parts:  # FP4 codes on the E2M1 grid, FP8 scales under the shared global scale
        codes = p.qweight.float().abs().unique()
        assert set(codes.tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
        written = linear_tensors("proj", p, torch.bfloat16)  # refuses scales that are not FP8 values under it
        assert torch.equal(written["proj.weight_global_scale"], shared)


def test_integer_rows_of_a_unit_solve_as_one_linear_at_a_time() -> None:
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(48, 64, generator=gen), torch.randn(16, 64, generator=gen)]
    hessian, scheme = _hessian(64, 3), parse_candidate("int4-g64")
    parts = solve_unit(weights, hessian, scheme, GPTQ, torch.bfloat16, "gate_up")
    for w, part in zip(weights, parts, strict=True):
        alone = gptq_solve(w, hessian, scheme, GPTQ, scale_dtype=torch.bfloat16).weight
        assert torch.allclose(part.dequantize(), alone.dequantize(), atol=1e-6)


def _unit(name: str, errors: dict[str, float]) -> UnitMeasurement:
    shapes = [(64, 128)]
    options = {c: CandidateCost(e, storage_bits(parse_candidate(c), *shapes[0])) for c, e in errors.items()}
    return UnitMeasurement(name, [name], 64 * 128, options)


def test_the_planner_picks_a_float_candidate_where_it_pays(tmp_path: Path) -> None:
    """Budget for one nvfp4 unit beside an int4-g64 one: the unit that gains most from nvfp4 gets it; a bigger
    budget buys fp8 where the error drop per bit is largest."""
    candidates = ["int4-g64", "nvfp4", "fp8", "fp16"]
    units = [
        _unit("a", {"int4-g64": 1.0, "nvfp4": 0.2, "fp8": 0.01, "fp16": 0.0}),
        _unit("b", {"int4-g64": 1.0, "nvfp4": 0.9, "fp8": 0.05, "fp16": 0.0}),
    ]
    measurement = Measurement("m", "hybrid", candidates, units)
    budget = HAND_BITS["nvfp4"] + storage_bits(parse_candidate("int4-g64"), 64, 128)
    chosen = plan(measurement, max_size_mb=budget / 8e6)
    assert [u.candidate for u in chosen.units] == ["nvfp4", "int4-g64"]
    assert chosen.total_bits == budget and chosen.predicted_error == pytest.approx(1.2)
    chosen = plan(measurement, max_size_mb=(HAND_BITS["fp8"] + HAND_BITS["nvfp4"]) / 8e6)
    assert [u.candidate for u in chosen.units] == ["nvfp4", "fp8"]  # 0.85 saved on b vs 0.19 on a
    path = save_plan(chosen, tmp_path / "plan.yaml")
    rules = load_plan(path)
    assert [r.scheme for r in rules.rules] == [parse_candidate("nvfp4"), parse_candidate("fp8")]
