"""The loop over decoder blocks that quantization and sensitivity share.

:func:`walk_blocks` visits the blocks of a skeleton model in order, each loaded from the source shards before the
visit and released after it, with the freed heap returned to the OS and the progress bar advanced, so one block's
weights are in memory at a time. :func:`stage_hessians` runs a :class:`StagedBlock` stage by stage and yields each
stage with the Hessian of its inputs, summed over the mini-batches in the fixed order of
:mod:`quantkit.distributed.reduce` (the same bits on one process or several).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from quantkit.distributed.reduce import CHUNK_BATCHES, BatchTree, Node, chunks_of, combine
from quantkit.memory import release_freed_memory
from quantkit.model.architectures import ArchSpec, Stage
from quantkit.model.blocks import embed, get_module
from quantkit.model.source_weights import SourceWeights, load_module, release_module
from quantkit.model.staged_block import StagedBlock
from quantkit.progress import progress_bar
from quantkit.quantization.methods.hooks import Companion
from quantkit.quantization.statistics import HessianStat


@dataclass(slots=True)
class BlockVisit:
    index: int
    prefix: str  # full module name, e.g. "model.layers.3"
    module: nn.Module


def walk_blocks(
    model: nn.Module,
    arch: ArchSpec,
    weights: SourceWeights | None,
    *,
    description: str,
    first: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    show_progress: bool = True,
) -> Iterator[BlockVisit]:
    """Each decoder block from ``first`` on, with its weights loaded (as ``dtype``, onto ``device``; None: the CPU)
    from ``weights`` during the visit and released after it. ``weights`` None: the model is already loaded; blocks
    are visited as they are."""
    layers = get_module(model, arch.layers_path)
    with progress_bar(show_progress) as bar:
        task = bar.add_task(description, total=len(layers), completed=first, unit="block")
        for index in range(first, len(layers)):
            prefix = f"{arch.layers_path}.{index}"
            block = layers[index]
            if weights is not None:
                load_module(block, prefix, weights, dtype=dtype, device=device)
            yield BlockVisit(index, prefix, block)
            if weights is not None:
                release_module(block)
            release_freed_memory()
            bar.advance(task)


Partials = list[tuple[Node, torch.Tensor]]


@dataclass(slots=True)
class BatchShare:
    """Which of the run's mini-batches this process holds: ``[first, first + its own)`` of ``total`` (None: all of
    them, one process; ``first`` starts a chunk of :mod:`quantkit.distributed.reduce`). ``finish`` (several
    processes) turns this process's partial sums and row count into every process's partials and the total count,
    or into None where the stage's Hessian is not needed."""

    first: int = 0
    total: int | None = None
    finish: Callable[[Stage, Partials, int], tuple[Partials | None, int]] | None = None
    # every process's partials of one more sum (a companion's), on the processes that get the Hessian (else None)
    exchange: Callable[[Stage, Partials], Partials | None] | None = None


def stage_hessians(
    staged: StagedBlock,
    *,
    with_hessian: bool = True,
    companions: Sequence[Companion] = (),
    share: BatchShare | None = None,
) -> Iterator[tuple[Stage, torch.Tensor | None, list[Any]]]:
    """Run ``staged`` stage by stage, in order; yield each stage with the Hessian ``2 X^T X / n`` of its inputs
    and what each companion collected over the stage (a target algorithm's view of the float block: see
    :class:`quantkit.quantization.methods.hooks.Companion`).

    ``with_hessian`` False: the stages only run (for the block's output), and None is yielded. Use a stage's
    Hessian (e.g. solve and write back its weights) before asking for the next stage: the next one's inputs are
    computed from the block as it is then.

    ``share``: this process's part of the mini-batches when several run the block (None: one process holds all);
    a process that does not solve the stage gets a None Hessian.
    """
    share = share or BatchShare()
    local = len(list(staged.batches()))
    batches = local if share.total is None else share.total
    assert share.first % CHUNK_BATCHES == 0, "a process's batches start a chunk"
    first_chunk, total = share.first // CHUNK_BATCHES, chunks_of(batches)
    for stage in staged.stages:
        k = get_module(staged.block, stage.head).in_features
        tree = BatchTree(total, first_chunk, chunks_of(share.first + local)) if with_hessian else None
        sums: list[dict[str, BatchTree]] = [{} for _ in companions]  # a summing companion's sums, by key
        count = _accumulate(staged, stage, k, tree, companions, share.first, batches, sums)
        hessian = None
        if tree is not None:
            parts: Partials | None = tree.nodes()
            if share.finish is not None:
                parts, count = share.finish(stage, tree.nodes(), count)
            for companion, trees in zip(companions, sums, strict=True):
                if hasattr(companion, "take_chunk"):
                    companion.put_totals(_companion_totals(trees, stage, share, total, parts is not None), count)
            if parts is not None:
                hessian = _hessian_or_unseen(staged, stage, HessianStat(combine(parts, total), count), k)
            elif count == 0:
                staged.unseen_stages.add(stage.name)
            del parts
        stage_data = [companion.close_stage() for companion in companions]
        del tree, sums
        release_freed_memory()  # the stage's mini-batch temporaries, before the solver allocates its own
        yield stage, hessian, stage_data
        del hessian, stage_data  # not held while the next stage's inputs are computed


def _companion_totals(
    trees: dict[str, BatchTree], stage: Stage, share: BatchShare, total: int, wanted: bool
) -> dict[str, torch.Tensor] | None:
    """A summing companion's sums over every mini-batch (every process's, in the Hessians' order), on a process
    that gets the stage's Hessian (``wanted``); None on the others."""
    out = {}
    for key in sorted(trees):  # the same keys, in the same order, on every process
        parts: Partials | None = trees[key].nodes()
        if share.exchange is not None:
            parts = share.exchange(stage, trees[key].nodes())
        if parts is not None:
            out[key] = combine(parts, total)
    return out if wanted else None


def _hessian_or_unseen(staged: StagedBlock, stage: Stage, stat: HessianStat, k: int) -> torch.Tensor:
    """The stage's Hessian; for inputs no calibration row reached (an expert the router never picked, under routed
    calibration) the identity, with which GPTQ's error feedback vanishes and its solve is round-to-nearest; the
    stage is added to ``staged.unseen_stages`` so that the solve loop records it as a fallback."""
    if stat.count == 0:
        staged.unseen_stages.add(stage.name)
        return torch.eye(k, device=stat.gram.device)
    return stat.take_hessian()


def _accumulate(
    staged: StagedBlock,
    stage: Stage,
    k: int,
    tree: BatchTree | None,
    companions: Sequence[Companion],
    first: int,
    batches: int,
    sums: Sequence[dict[str, BatchTree]],
) -> int:
    """Run a stage over every mini-batch (``first`` is the first one's index of all ``batches``), summing the Gram
    matrices of each chunk's batches into one statistic and pushing it into ``tree`` when the chunk is complete, and
    showing the inputs to each companion beside its own; returns the rows seen. A summing companion's sums
    (:class:`~quantkit.quantization.methods.hooks.SummingCompanion`) are taken at the same chunk ends and pushed
    into its trees in ``sums``. The last input (it may be a view of a reused [rows, intermediate] buffer) goes out
    of scope on return, before the solver runs.

    One inference-mode context spans every generator: each enters its own, and they finish in another order than
    they started, which would otherwise leave inference mode switched on after the call.
    """
    count = 0
    chunk: HessianStat | None = None
    with torch.inference_mode():
        own = [companion.open_stage(staged, stage, k) for companion in companions]
        for index, (rows, x) in enumerate(zip(staged.batches(), staged.stage_inputs(stage.name), strict=True)):
            batch = first + index
            if tree is not None:
                if chunk is None:
                    with torch.inference_mode(False):  # a normal tensor: the Hessian is made from it in place later
                        chunk = HessianStat.zeros(k, device=staged.hidden.device)
                chunk.update(x)
            for companion, inputs in zip(companions, own, strict=True):
                companion.observe(staged, stage, rows, x, next(inputs))
            if tree is not None and (batch % CHUNK_BATCHES == CHUNK_BATCHES - 1 or batch == batches - 1):
                assert chunk is not None
                tree.push(chunk.gram)
                count += chunk.count
                chunk = None
                for companion, trees in zip(companions, sums, strict=True):
                    if hasattr(companion, "take_chunk"):
                        for key, value in companion.take_chunk().items():
                            trees.setdefault(key, BatchTree(tree.total, tree.first, tree.stop)).push(value)
        for inputs in own:
            for _ in inputs:  # runs the companion's stage to its end (its state for the next stage)
                raise AssertionError("a companion yielded more mini-batches than the quantized block")
    return count


def embed_inputs(
    model: nn.Module, arch: ArchSpec, weights: SourceWeights | None, input_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The first block's input: the embeddings of ``input_ids``, stored as ``dtype``. ``weights``: read from them
    (None: the model holds its weights already): for a plain lookup table only the rows the windows use, else the
    whole embedding, loaded for the call and released after."""
    embedding = get_module(model, arch.embed_path)
    if weights is not None and type(embedding) is nn.Embedding:  # a pure gather: the same values from the rows
        unique, inverse = torch.unique(input_ids, return_inverse=True)
        rows = weights.rows(f"{arch.embed_path}.weight", unique).to(dtype)
        with torch.inference_mode():
            return functional.embedding(inverse, rows).to(dtype)
    if weights is not None:
        load_module(embedding, arch.embed_path, weights, dtype=dtype)
    hidden = embed(model, arch, input_ids, dtype)
    if weights is not None:
        release_module(embedding)
    return hidden
