"""Whole-model budgets: ``plan --max-size-mb --whole-model`` counts the embedding, the norms and the head (float,
quantized, or tied), and the checkpoint quantize writes from the plan fits the budget (inspect's tensor bytes);
impossible requests are refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.tiny import build_word_tokenizer, tiny_llama

from quantkit.errors import QuantkitError
from quantkit.format.inspect import inspect_checkpoint
from quantkit.mixed.candidates import parse_candidate, unit_storage_bits
from quantkit.mixed.measurement import CandidateCost, Measurement, UnitMeasurement
from quantkit.mixed.planner import plan
from quantkit.mixed.whole_model import SHAPE_BITS, outer_cost
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.head_quant import HeadQuantConfig
from quantkit.quantization.pipeline import quantize_model

CANDS = ["int4-g32", "int8", "fp16"]
SHAPES = {  # the tiny Llama: (out, in)
    "self_attn.q_proj": (64, 64),
    "self_attn.k_proj": (32, 64),
    "self_attn.v_proj": (32, 64),
    "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (160, 64),
    "mlp.up_proj": (160, 64),
    "mlp.down_proj": (64, 160),
}
FUSED = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"]}
FUSED |= {"gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
VOCAB, HIDDEN = 256, 64


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    """The tiny Llama stored in bfloat16: 16-bit scales, as the planner counts them."""
    path = tmp_path_factory.mktemp("bf16") / "model"
    tiny_llama(bos_token_id=1, eos_token_id=2).to(torch.bfloat16).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


def _measurement(model: Path) -> Measurement:
    units = []
    for layer in range(2):
        for i, (unit, rel) in enumerate(FUSED.items()):
            shapes = [SHAPES[r] for r in rel]
            params = sum(n * k for n, k in shapes)
            options = {}
            for cand in CANDS:
                scheme = parse_candidate(cand)
                error = 0.0 if scheme is None else params * (1 + i + layer) * 4.0**-scheme.bits
                options[cand] = CandidateCost(error, unit_storage_bits(scheme, shapes))
            prefix = f"model.layers.{layer}."
            units.append(UnitMeasurement(prefix + unit, [prefix + r for r in rel], params, options))
    return Measurement(str(model), "proxy", list(CANDS), units)


def test_outer_cost_counts_every_tensor_outside_the_linears(bf16_model):
    measurement = _measurement(bf16_model)
    norms = (2 * 2 + 1) * HIDDEN * 16
    shapes = SHAPE_BITS * 2 * len(SHAPES)
    floated = outer_cost(measurement, bf16_model)
    assert floated.fixed_bits == VOCAB * HIDDEN * 16 + norms + shapes
    assert (floated.head, floated.head_bits) == ("float", VOCAB * HIDDEN * 16)
    int8 = outer_cost(measurement, bf16_model, "int8")
    assert int8.head_bits == VOCAB * HIDDEN * 8 + VOCAB * 16 + SHAPE_BITS


def test_the_planned_checkpoint_fits_the_whole_model_budget(bf16_model, tiny_calib_file, tmp_path):
    measurement = _measurement(bf16_model)
    cost = outer_cost(measurement, bf16_model, "int8")
    linears_int4 = sum(u.options["int4-g32"].bits for u in measurement.units)
    budget_mb = (cost.bits + linears_int4 + 20_000 * 8) / 8e6  # room for a few int8 units, not all
    chosen = plan(measurement, max_size_mb=budget_mb, outer_bits=cost.bits)
    assert chosen.whole_model_mb <= budget_mb
    assert {u.candidate for u in chosen.units} >= {"int8", "int4-g32"}  # the budget binds: a real trade-off
    planned = {m: parse_candidate(u.candidate) for u in chosen.units for m in u.modules}
    config = QuantizeConfig.for_method(
        "rtn", HeadQuantConfig("int8", solver="rtn"), planned=planned, calibration_file=tiny_calib_file,
        show_progress=False,
    )  # fmt: skip
    out = tmp_path / "planned"
    quantize_model(str(bf16_model), config, out)
    report = inspect_checkpoint(out)
    assert report.tensor_bytes <= budget_mb * 1e6
    assert report.tensor_bytes * 8 <= chosen.total_bits + cost.bits  # the estimate is an upper bound
    assert report.tensor_bytes * 8 >= chosen.total_bits + cost.bits - SHAPE_BITS * 14  # ... by the shapes at most
    linears_only = plan(measurement, max_size_mb=budget_mb)
    assert linears_only.total_bits > chosen.total_bits  # without the outer bytes the plan would overshoot


def test_a_whole_model_budget_below_the_outer_bytes_is_refused(bf16_model):
    measurement = _measurement(bf16_model)
    cost = outer_cost(measurement, bf16_model)
    with pytest.raises(QuantkitError, match="outside the measured linears"):
        plan(measurement, max_size_mb=math.floor(cost.bits / 8) / 1e6, outer_bits=cost.bits)


def test_a_quantized_tied_head_is_refused_unless_untied(tmp_path):
    path = tmp_path / "tied"
    tiny_llama(tie_word_embeddings=True).to(torch.bfloat16).save_pretrained(path)
    measurement = _measurement(path)
    with pytest.raises(QuantkitError, match="ties its head to the embedding"):
        outer_cost(measurement, path, "int8")
    assert outer_cost(measurement, path).head == "tied" and outer_cost(measurement, path).head_bits == 0
    with pytest.raises(QuantkitError, match="--embedding int8: the model ties its head"):
        outer_cost(measurement, path, embedding="int8")
    both = outer_cost(measurement, path, "int8", untied_head=True, embedding="int8")
    assert both.fixed_bits == outer_cost(measurement, path, untied_head=True).fixed_bits - VOCAB * HIDDEN * 8 + (
        VOCAB * 16 + SHAPE_BITS
    )  # the table's 16 bits a weight become 8, plus one bf16 scale a row and its weight_shape
    untied = outer_cost(measurement, path, "w4g32", untied_head=True)
    assert untied.head_bits == VOCAB * HIDDEN * 4 + VOCAB * 2 * 16 + SHAPE_BITS  # 4-bit codes, 2 bf16 scales a row


def test_the_cli_plans_a_whole_model_budget(bf16_model, tmp_path, capsys):
    measurement = _measurement(bf16_model)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(measurement.to_dict()))
    args = ["plan", str(path), "-o", str(tmp_path / "plan.yaml"), "--max-size-mb", "0.2", "--whole-model"]
    code, out, _ = run_cli([*args, "--head", "int8"], capsys)
    assert code == 0 and "whole model:" in out and "head: int8" in out
    code, _, err = run_cli(
        ["plan", str(path), "-o", str(tmp_path / "p2.yaml"), "--target-bits", "5", "--head", "int8"], capsys
    )
    assert code != 0 and "give --whole-model --max-size-mb" in err
