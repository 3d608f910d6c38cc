"""The run's memory strategy: a parked Hessian leaves memory and comes back bit for bit, and GPTQ gives the same
result with its Hessian parked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.matrices import spd

from quantkit.quantization.memory_strategy import HessianParking, MemoryStrategy


def test_a_parked_hessian_frees_its_memory_and_comes_back_unchanged(tmp_path: Path) -> None:
    h = spd(64)
    view, before = h.detach(), h.clone()
    parking = HessianParking(h, tmp_path / "h.spill")
    parking.park()
    assert h.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    parking.unpark()
    assert torch.equal(h, before) and torch.equal(view, before)
    HessianParking(h, None).park()  # no scratch file: nothing happens
    assert torch.equal(h, before)


@pytest.mark.parametrize("damp", [0.01, 0.0])  # 0.0 on a singular H: a failed attempt, then a retry
def test_gptq_with_a_parked_hessian_gives_the_same_result(tmp_path: Path, damp: float) -> None:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantization.methods.gptq import GPTQConfig
    from quantkit.quantization.solvers.gptq import gptq_solve

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 48, generator=gen) @ torch.randn(48, 48, generator=gen)  # rank 16 < 48
    h = 2.0 * x.T @ x / 16
    h = torch.triu(h) + torch.triu(h, diagonal=1).T
    w = torch.randn(8, 48, generator=gen)
    scheme, config = QuantScheme(bits=4, group_size=16, act_order=True), GPTQConfig(damp=damp)
    plain = gptq_solve(w, h, scheme, config)
    before = h.clone()
    parked = gptq_solve(
        w.clone(), h, scheme, config, overwrite=True, parking=MemoryStrategy(hessian_file=tmp_path / "h.spill").parking
    )
    assert torch.equal(h, before) and parked.damp == plain.damp and parked.loss == plain.loss
    assert torch.equal(parked.weight.qweight, plain.weight.qweight)
    assert torch.equal(parked.weight.scale, plain.weight.scale)
