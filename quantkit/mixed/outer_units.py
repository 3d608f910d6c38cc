"""The head and the embedding as sensitivity units (``quantkit sensitivity --outer``), so that ``plan --head auto
--embedding auto`` chooses their schemes jointly with the linears'.

Each candidate quantizes that one tensor as ``quantize`` writes it: the head as ``--quantize-head`` solves it by
default (GPTQ on the Hessian of the final hidden states of every calibration window, act-order in static groups and
a Hessian-weighted range search), the embedding as ``--quantize-embedding`` does (round-to-nearest with a range
search per group). The error is the mean final-logit KL from the float model on the KL windows, the scale of the
linears' kl/hybrid errors. The float option ("none") has error 0. Bits are counted as
:func:`quantkit.mixed.whole_model.outer_cost` counts them (16-bit scales, the ``weight_shape``); the planner reads
the bits from the source's shard headers again, so these are for the reader.

A tied head is measured as the untied copy a rotation would write: the head's logits are computed from the quantized
matrix without touching the embedding, and the embedding's forward swaps in its own quantized table only.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.eval.logit_metrics import token_kl
from quantkit.format.engines import layout_problem
from quantkit.format.outer_engines import embedding_problem
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import storage_bits
from quantkit.mixed.measurement import CandidateCost, OuterMeasurement
from quantkit.mixed.unit_error import KLReference
from quantkit.mixed.whole_model import SHAPE_BITS
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import get_module
from quantkit.quantization.methods.head_quant import OFF, head_hessian, head_scheme, quantize_head
from quantkit.quantization.solvers.grid import quantize_rtn

DEFAULT_OUTER = ("int8", "w4g64")  # the spellings `--outer-candidates` measures unless told
SOLVERS = {"head": "gptq", "embedding": "rtn"}  # recorded in the measurement's metadata


def check_outer_candidates(names: list[str]) -> None:
    """Each name must be a ``--quantize-head`` spelling of a quantized scheme."""
    if not names:
        raise QuantkitError("--outer-candidates is empty; list at least one head scheme, e.g. int8,w4g64")
    for name in names:
        if head_scheme(name, "rtn") is None:
            raise QuantkitError("--outer-candidates lists quantized schemes (int8, w4g64, ...); 'none' is implied")


def _loadable(names: list[str], hidden: int, solver: str, embedding: bool) -> dict[str, QuantScheme]:
    """The candidates whose group divides the hidden size (and, for the embedding, that vLLM loads)."""
    schemes = {name.strip().lower(): head_scheme(name, solver) for name in names}
    return {
        name: s
        for name, s in schemes.items()
        if s is not None and layout_problem(s, hidden) is None and not (embedding and embedding_problem(s))
    }


def _bits(scheme: QuantScheme | None, shape: tuple[int, int], float_bits: int) -> int:
    return math.prod(shape) * float_bits if scheme is None else storage_bits(scheme, *shape) + SHAPE_BITS


def measure_outer(
    kl: KLReference,
    arch: ArchSpec,
    ids: torch.Tensor,
    final: torch.Tensor,
    names: list[str],
    storage: torch.dtype,
    eps: float,
) -> list[OuterMeasurement]:
    """The head and the embedding units. ``kl.hidden``: the KL windows' last-block output (after the block walk);
    ``ids``: the KL windows' tokens; ``final``: every calibration window's last-block output (the head's Hessian)."""
    model = kl.model
    head_module = get_module(model, arch.lm_head_path)
    embed_module = get_module(model, arch.embed_path)
    norm = get_module(model, arch.final_norm_path)
    float_bits = storage.itemsize * 8
    shape = tuple(head_module.weight.shape)
    assert len(shape) == 2
    hidden = shape[1]

    head_options = {OFF: CandidateCost(0.0, _bits(None, shape, float_bits))}
    hessian = head_hessian(final, norm.weight.detach(), eps)
    weight = head_module.weight.detach().float().cpu()
    with torch.inference_mode():
        normed = norm(kl.hidden)
    for name, scheme in _loadable(names, hidden, SOLVERS["head"], embedding=False).items():
        solved = quantize_head(weight, scheme, storage, hessian).dequantize().to(normed.device, normed.dtype)
        with torch.inference_mode():
            logits = nn.functional.linear(normed, solved, head_module.bias)  # the module (maybe tied) is untouched
        head_options[name] = CandidateCost(_kl(kl.reference, logits), _bits(scheme, shape, float_bits))

    table = embed_module.weight
    embed_shape = tuple(table.shape)
    embed_options = {OFF: CandidateCost(0.0, _bits(None, embed_shape, float_bits))}
    for name, scheme in _loadable(names, hidden, SOLVERS["embedding"], embedding=True).items():
        rounded = quantize_rtn(table.detach(), scheme, scale_dtype=storage).dequantize().to(table.device, table.dtype)
        error = _embedding_kl(kl, embed_module, rounded, ids)
        embed_options[name] = CandidateCost(error, _bits(scheme, embed_shape, float_bits))
    return [
        OuterMeasurement("head", arch.lm_head_path, math.prod(shape), head_options),
        OuterMeasurement("embedding", arch.embed_path, math.prod(embed_shape), embed_options),
    ]


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    return float(token_kl(reference, logits.float()).mean())


def _embedding_kl(kl: KLReference, module: nn.Module, table: torch.Tensor, ids: torch.Tensor) -> float:
    """KL of the whole model with ``module`` reading ``table``: a new parameter on the embedding only, so a head tied
    to it keeps the float matrix (as the untied head of a rotated run does)."""
    original = module.weight
    module.weight = nn.Parameter(table, requires_grad=False)
    try:
        with torch.inference_mode():
            logits = kl.model(input_ids=ids, use_cache=False).logits
        return _kl(kl.reference, logits)
    finally:
        module.weight = original
