"""--compute-dtype: the staged passes' products in bfloat16 give float32 stage inputs close to float32's (the
inputs of a stage no product feeds are the same), the autocast never leaks to the caller between mini-batches, and
an unknown precision is refused with the choices."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny import tiny_llama

from quantkit.errors import QuantkitError
from quantkit.model.architectures import arch_for_model_type
from quantkit.model.blocks import BlockRunner
from quantkit.model.precision import COMPUTE_DTYPES, compute_dtype
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.config import QuantizeConfig


def test_an_unknown_compute_dtype_is_refused_with_the_choices() -> None:
    assert compute_dtype("bfloat16") is torch.bfloat16 and list(COMPUTE_DTYPES) == ["float32", "bfloat16"]
    wanted = "unknown --compute-dtype 'float16'; use one of float32, bfloat16"
    with pytest.raises(QuantkitError, match=wanted):
        compute_dtype("float16")
    with pytest.raises(QuantkitError, match=wanted):
        QuantizeConfig(compute_dtype="float16", calibration=None).validate()


def _staged_run(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every stage's inputs (all mini-batches) and the block output of a tiny Llama block run in ``dtype``."""
    model = tiny_llama(seed=3)
    arch = arch_for_model_type("llama")
    runner = BlockRunner.for_model(model, arch, 16, batch_size=2, compute_dtype=dtype)
    hidden = torch.randn(5, 16, 64, generator=torch.Generator().manual_seed(1))
    staged = StagedBlock(copy.deepcopy(model.model.layers[0]), arch, runner, hidden)
    inputs = {}
    for stage in staged.stages:
        batches = []
        for x in staged.stage_inputs(stage.name):
            assert not torch.is_autocast_enabled("cpu")  # the products' precision stays inside the pass
            assert x.dtype == torch.float32
            batches.append(x.clone())  # down_proj's inputs live in a reused buffer
        inputs[stage.name] = torch.cat(batches)
    return inputs, staged.output()


def test_bfloat16_products_give_float32_inputs_close_to_float32s() -> None:
    exact, exact_output = _staged_run(torch.float32)
    low, low_output = _staged_run(torch.bfloat16)
    assert torch.equal(low["qkv"], exact["qkv"])  # a norm of the block input: no product
    for name in ("o", "gate_up", "down"):
        error = float((low[name] - exact[name]).norm() / exact[name].norm())
        assert 1e-5 < error < 2e-2, (name, error)  # bfloat16 ran (not float32), and stays close
    error = float((low_output - exact_output).norm() / exact_output.norm())
    assert 1e-6 < error < 1e-2
    assert not torch.is_autocast_enabled("cpu")
