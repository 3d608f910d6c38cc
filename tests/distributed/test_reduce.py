"""The fixed-order reduction: the sum of per-chunk partials is bit for bit the same whatever the number of processes
and wherever the chunks are cut, while a running sum cut the same way is not (so the check can fail); a block's
Hessians on one process are the running sums they always were while the batches make one chunk; the solve plan; the
torchrun environment and the refusals."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import tiny_llama

from quantkit.distributed.context import DistContext, SameOnEveryRank, world_from_env
from quantkit.distributed.plan import assign, makespan
from quantkit.distributed.reduce import CHUNK_BATCHES, BatchTree, chunk_ranges, combine, cover, is_node, split
from quantkit.model.architectures import arch_for_model_type
from quantkit.model.blocks import BlockRunner
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.block_loop import stage_hessians
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.distributed_run import RankBlocks, check_distributable
from quantkit.quantization.statistics import HessianStat


def _leaves(total: int, k: int = 48, seed: int = 0) -> list[torch.Tensor]:
    """Per-batch Gram matrices of inputs with a wide dynamic range (where summation order shows)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(total):
        x = torch.randn(37, k, generator=g) * torch.logspace(-3, 3, k)
        out.append(x.T @ x)
    return out


def _distributed_sum(leaves: list[torch.Tensor], ranges: list[tuple[int, int]]) -> torch.Tensor:
    total = len(leaves)
    parts = []
    for first, stop in ranges:
        tree = BatchTree(total, first, stop)
        for leaf in leaves[first:stop]:
            tree.push(leaf.clone())
        assert [node for node, _ in tree.nodes()] == cover(first, stop, total)
        parts += tree.nodes()
    return combine(parts, total)


@pytest.mark.parametrize("total", [1, 2, 3, 7, 8, 13])
def test_the_sum_is_the_same_bits_for_every_number_of_processes(total: int) -> None:
    leaves = _leaves(total)
    one = _distributed_sum(leaves, [(0, total)])
    for world in range(2, total + 1):
        assert torch.equal(_distributed_sum(leaves, chunk_ranges(total, world)), one), world
    if total >= 3:  # any contiguous cut, not only the balanced one
        assert torch.equal(_distributed_sum(leaves, [(0, 1), (1, total)]), one)
        assert torch.equal(_distributed_sum(leaves, [(0, total - 1), (total - 1, total)]), one)
    assert torch.allclose(one, torch.stack(leaves).double().sum(0).float(), rtol=1e-5, atol=1e-3)


def test_a_running_sum_cut_in_two_differs_so_the_check_can_fail() -> None:
    """The order matters in float32: a running sum over 13 batches and the same sum as two halves added differ."""
    leaves = _leaves(13)
    running = torch.zeros_like(leaves[0])
    for leaf in leaves:
        running += leaf
    first, second = torch.zeros_like(leaves[0]), torch.zeros_like(leaves[0])
    for leaf in leaves[:7]:
        first += leaf
    for leaf in leaves[7:]:
        second += leaf
    assert not torch.equal(first + second, running)


def test_the_tree_shape() -> None:
    assert split(0, 2) == 1 and split(0, 3) == 2 and split(0, 8) == 4 and split(0, 13) == 8 and split(8, 13) == 12
    assert is_node(0, 13, 13) and is_node(8, 12, 13) and is_node(12, 13, 13)
    assert not is_node(4, 12, 13) and not is_node(1, 3, 13)
    assert cover(0, 13, 13) == [(0, 13)]
    assert cover(3, 11, 13) == [(3, 4), (4, 8), (8, 10), (10, 11)]
    assert cover(5, 5, 13) == []
    assert chunk_ranges(5, 2) == [(0, 2), (2, 5)] and chunk_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_partial_sums_out_of_order_are_refused() -> None:
    leaves = _leaves(4)
    with pytest.raises(AssertionError, match="chunk order"):
        combine([((2, 4), leaves[2]), ((0, 2), leaves[0])], 4)


def test_a_tree_holds_few_partial_sums() -> None:
    """Pairwise merging: after each batch at most log2(batches) partial sums are held (one more while merging)."""
    tree = BatchTree(64)
    most = 0
    for leaf in _leaves(64, k=4):
        tree.push(leaf)
        most = max(most, len(tree._stack))
    assert most == 6 and len(tree.nodes()) == 1


def test_the_solve_plan_balances_by_cost() -> None:
    costs = [10, 7, 5, 4, 3, 1]
    owners = assign(costs, 2)
    assert owners == [0, 1, 1, 0, 1, 0]  # 10+4+1 = 15 against 7+5+3 = 15
    assert makespan(costs, owners, 2) == 15
    assert assign([5], 4) == [0]  # one solve: rank 0
    assert assign([3, 3, 3], 3) == [0, 1, 2]  # ties: in order, to the lowest free rank
    assert assign(costs, 1) == [0] * 6
    with pytest.raises(ValueError, match="positive"):
        assign(costs, 0)


def test_the_torchrun_environment() -> None:
    assert world_from_env({}) is None
    assert world_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None  # torchrun with one process: the plain path
    assert world_from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (1, 4, 1)
    with pytest.raises(Exception, match="outside WORLD_SIZE"):
        world_from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_windows_are_cut_at_chunk_boundaries() -> None:
    assert CHUNK_BATCHES == 4
    blocks = RankBlocks.plan(DistContext(rank=1, world=2), num_windows=18, batch_size=2)  # 9 batches, 3 chunks
    assert blocks.ranges == [(0, 1), (1, 3)] and blocks.windows == [8, 10] and blocks.rows == slice(8, 18)
    blocks = RankBlocks.plan(DistContext(rank=2, world=3), num_windows=23, batch_size=2)  # 12 batches, 3 chunks
    assert blocks.windows == [8, 8, 7] and blocks.rows == slice(16, 23)
    with pytest.raises(SameOnEveryRank, match=r"fewer than the 4 processes .* at least 32 windows"):
        RankBlocks.plan(DistContext(rank=0, world=4), num_windows=24, batch_size=2)


def _block_hessians(batches: int, batch_size: int = 2) -> tuple[dict, dict]:
    """A tiny Llama block's stage Hessians from stage_hessians, and the running sums of the same inputs."""
    model = tiny_llama(seed=3)
    arch = arch_for_model_type("llama")
    runner = BlockRunner.for_model(model, arch, 16, batch_size=batch_size)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(batches * batch_size, 16, 64, generator=gen).to(torch.bfloat16)
    got = {s.name: h for s, h, _ in stage_hessians(StagedBlock(model.model.layers[0], arch, runner, hidden.clone()))}
    staged = StagedBlock(model.model.layers[0], arch, runner, hidden.clone())
    running = {}
    for stage in arch.stages:
        with torch.inference_mode(False):  # the stage's generator leaves inference mode on between batches
            stat = HessianStat.zeros(model.model.layers[0].get_submodule(stage.head).in_features)
        for x in staged.stage_inputs(stage.name):
            stat.update(x)
        running[stage.name] = stat.take_hessian()
    return got, running


def test_one_chunk_is_the_running_sum_it_always_was() -> None:
    """Up to CHUNK_BATCHES mini-batches, one process's Hessians are the old running sums, bit for bit (the
    single-process bytes of such runs do not change); with more, they are close but summed in the tree's order."""
    got, running = _block_hessians(CHUNK_BATCHES)
    assert all(torch.equal(got[name], running[name]) for name in running)
    got, running = _block_hessians(3 * CHUNK_BATCHES - 1)
    assert all(torch.allclose(got[name], running[name], rtol=1e-5, atol=1e-6) for name in running)


def test_what_does_not_run_distributed_is_refused_in_one_line() -> None:
    from quantkit.format.presets import PRESETS
    from quantkit.quantization.methods.tune import TuneConfig

    two = DistContext(rank=0, world=2)
    mse_routed = {"scheme": PRESETS["FP8"], "activation_observer": "mse", "moe_calibration": "routed"}
    with pytest.raises(SameOnEveryRank, match=r"^static input scales by the mse observer .* yet; .*one process"):
        check_distributable(QuantizeConfig.for_method("gptq", **mse_routed), two)
    for method in ("gptq", "rtn", "awq", "awq+gptq", "smoothquant+gptq"):  # these run distributed
        check_distributable(QuantizeConfig.for_method(method), two)
    check_distributable(QuantizeConfig.for_method("gptq", TuneConfig(steps=2)), two)
    check_distributable(QuantizeConfig.for_method("gptq", scheme=PRESETS["FP8"], kv_cache_scheme="fp8"), two)
    check_distributable(QuantizeConfig.for_method("gptq", scheme=PRESETS["FP8"], activation_observer="mse"), two)
