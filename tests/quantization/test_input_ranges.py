"""Static input scales from calibration ranges (minmax and MSE observers) and the FP8 KV cache's scales."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.input_quant import fake_quantize_input
from quantkit.format.kv_cache import fake_quantize_kv
from quantkit.format.presets import PRESETS
from quantkit.model.kv_attention import kv_scales
from quantkit.quantization.input_ranges import (
    MSE_SAMPLE_ROWS,
    MSE_SHRINKS,
    InputRange,
    InputRangeObserver,
    merge_ranges,
    sample_stride,
)

FP8_STATIC = PRESETS["FP8"].activations


def _heavy_tailed(rows: int = 512, features: int = 64) -> torch.Tensor:
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(0))
    x[7, 5] = 400.0  # one token far outside the rest: the minmax range spends FP8's top on it
    return x


def _error(x: torch.Tensor, scale: torch.Tensor) -> float:
    return float((fake_quantize_input(x, FP8_STATIC, scale) - x).square().sum())


def test_minmax_stores_absmax_over_448_rounded_as_stored():
    found = InputRange(absmax=300.0, sample=torch.empty(0, 0))
    assert float(found.scale(FP8_STATIC, torch.bfloat16, "minmax")) == float(torch.tensor(300.0 / 448).bfloat16())


def test_mse_picks_the_tried_range_with_the_lowest_error():
    x = _heavy_tailed()
    found = InputRange(absmax=float(x.abs().amax()), sample=x)
    mse = found.scale(FP8_STATIC, torch.float32, "mse")
    tried = [found.scale(FP8_STATIC, torch.float32, "minmax")]
    tried += [InputRange(found.absmax * shrink, x).scale(FP8_STATIC, torch.float32, "minmax") for shrink in MSE_SHRINKS]
    assert _error(x, mse) == min(_error(x, scale) for scale in tried)
    flat = torch.full((4, 64), 3.0)  # every value at the max: clipping only hurts
    even = InputRange(absmax=3.0, sample=flat)
    assert torch.equal(even.scale(FP8_STATIC, torch.float32, "mse"), even.scale(FP8_STATIC, torch.float32, "minmax"))


def test_the_nvfp4_input_stores_a_global_scale():
    found = InputRange(absmax=12.0, sample=torch.empty(0, 0))
    assert float(found.scale(PRESETS["NVFP4"].activations, torch.bfloat16, "minmax")) == pytest.approx(448 * 6 / 12)


def test_the_observer_keeps_every_nth_row_across_batches():
    observer = InputRangeObserver(sample_every=3)
    rows = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    for batch in (rows[:4], rows[4:7], rows[7:]):
        observer.observe(None, None, slice(None), batch.unsqueeze(0), None)
    found = observer.close_stage()
    assert found.absmax == 19.0
    assert torch.equal(found.sample, rows[::3])


def _observed(observer: InputRangeObserver, batches: list[torch.Tensor]) -> InputRange:
    for batch in batches:
        observer.observe(None, None, slice(None), batch.unsqueeze(0), None)
    return observer.close_stage()


def test_the_sample_is_a_copy_of_inputs_in_a_reused_buffer():
    """down_proj's inputs live in one buffer each mini-batch overwrites: the sample keeps the rows as they were."""
    buffer = torch.zeros(4, 2)
    observer = InputRangeObserver(sample_every=1)
    for value in (1.0, 2.0, 3.0):
        buffer.fill_(value)
        observer.observe(None, None, slice(None), buffer.unsqueeze(0), None)
    found = observer.close_stage()
    assert found.sample[:, 0].tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 4


def test_shares_of_the_rows_merge_into_the_range_of_all():
    """Each process observes its rows from its first row's index on; the ranges merged in row order are those of
    one observer over every row (the MSE sample keeps the same global stride)."""
    rows = torch.randn(23, 4, generator=torch.Generator().manual_seed(3))
    whole = _observed(InputRangeObserver(sample_every=3), [rows[:5], rows[5:11], rows[11:17], rows[17:]])
    first = _observed(InputRangeObserver(sample_every=3), [rows[:5], rows[5:11]])
    second = _observed(InputRangeObserver(sample_every=3, first_row=11), [rows[11:17], rows[17:]])
    merged = merge_ranges([first, second])
    assert merged.absmax == whole.absmax and torch.equal(merged.sample, whole.sample)
    assert torch.equal(merged.sample, rows[::3])


def test_the_sample_is_bounded():
    assert sample_stride(10 * MSE_SAMPLE_ROWS, "mse") == 10 and sample_stride(10**6, "minmax") == 0


def test_kv_scales_per_layer_and_per_head():
    absmax = torch.tensor([[4.48, 8.96], [44.8, 0.0]])  # keys, values per KV head
    per_layer = kv_scales(absmax, per_head=False, dtype=torch.float32)
    assert per_layer["k_scale"].shape == (1,) and float(per_layer["k_scale"]) == pytest.approx(8.96 / 448)
    per_head = kv_scales(absmax, per_head=True, dtype=torch.float32)
    assert per_head["v_scale"].shape == (2, 1, 1) and float(per_head["v_scale"][0]) == pytest.approx(0.1)
    assert float(per_head["v_scale"][1]) > 0  # an all-zero head still gets a usable scale


def test_the_fp8_cache_rounds_each_head_under_its_own_scale():
    states = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(1))
    states[:, 1] *= 1e6  # the first head under the second one's scale falls into FP8's subnormals
    absmax = states.abs().amax(dim=(0, 2, 3))
    per_head = absmax.reshape(2, 1, 1) / 448
    shared = absmax.amax().reshape(1) / 448
    head_error = (fake_quantize_kv(states, per_head) - states)[:, 0].abs().max()
    shared_error = (fake_quantize_kv(states, shared) - states)[:, 0].abs().max()
    assert head_error < shared_error  # the small head keeps FP8's precision under its own scale
    assert torch.equal(fake_quantize_kv(states, shared)[:, 1].abs().amax(), states[:, 1].abs().amax())
