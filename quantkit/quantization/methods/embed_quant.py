"""Embedding quantization (``--quantize-embedding``): the token table written as a quantized embedding, rounded to
nearest with a range search per group, or (``--embedding-solver gptq``) solved by GPTQ under the Fisher of the first
residual stream (:mod:`quantkit.quantization.methods.embed_fisher`: a lookup has no input statistics, so the
weighting comes from a backward pass of the float model on a few calibration windows).

Two layouts (``--embedding-layout``): compressed-tensors ``pack-quantized``, packed along the hidden size like a
Linear's weight (vLLM loads it), or, for int8, ``naive-quantized``, the codes a byte each as ``weight`` itself
(transformers loads it). No one layout loads in both.

vLLM loads a quantized embedding for symmetric INT weights per channel or in groups, for lookups only
(``quantkit.format.outer_engines``): an embedding tied to the head is refused (quantizing it would quantize the head
through the same matrix, which vLLM's quantized embedding cannot serve); with ``--rotate hadamard`` the head is
untied and the rotated table is the one quantized. The blocks are calibrated on the float table's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.format.engines import layout_problem
from quantkit.format.outer_engines import embedding_problem
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.model.source_weights import config_json, head_is_tied
from quantkit.quantization.methods.embed_fisher import residual_fisher
from quantkit.quantization.methods.head_quant import OFF, head_scheme, quantize_head
from quantkit.quantization.methods.hooks import Hooks, JobView, WorkView
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.solvers.grid import quantize_rtn

PACKED, UNPACKED = "packed", "unpacked"
EMBEDDING_LAYOUTS = (PACKED, UNPACKED)
EMBEDDING_SOLVERS = ("rtn", "gptq")


@dataclass(frozen=True)
class EmbedQuantConfig:
    scheme: str = option(
        OFF,
        "Quantize the embedding (an untied one, or with --rotate hadamard): none, int8, w4g64, w<bits>g<group>.",
        flag="--quantize-embedding",
    )
    layout: str = option(
        PACKED,
        "How the quantized embedding is stored: packed (into int32 words; vLLM loads it) or unpacked (int8 codes a "
        "byte each, compressed-tensors' naive-quantized; transformers loads it). unpacked takes int8.",
        flag="--embedding-layout",
    )

    solver: str = option(
        "rtn",
        "Embedding solver: rtn (round-to-nearest with a range search per group) or gptq (GPTQ under the Fisher of "
        "the first residual stream, from a backward pass of the float model on the first calibration windows).",
        flag="--embedding-solver",
    )
    # more windows estimate the Fisher better, each a forward and backward pass of the model (docs/benchmarks.md)
    fisher_windows: int = option(16, "Calibration windows the gptq solver's Fisher is summed over.", cli=False)

    def __post_init__(self) -> None:
        if self.solver not in EMBEDDING_SOLVERS:
            raise QuantkitError(f"unknown embedding solver '{self.solver}'; use one of {', '.join(EMBEDDING_SOLVERS)}")
        if self.fisher_windows < 1:
            raise QuantkitError(f"embedding fisher_windows must be >= 1, got {self.fisher_windows}")
        if self.layout not in EMBEDDING_LAYOUTS:
            raise QuantkitError(f"unknown embedding layout '{self.layout}'; use one of {', '.join(EMBEDDING_LAYOUTS)}")
        _ = self.resolved  # the spelling (the same as --quantize-head's) and the layout, checked before any work

    @property
    def resolved(self) -> QuantScheme | None:
        scheme = head_scheme(self.scheme, "rtn")
        if scheme is None or self.layout == PACKED:
            return scheme
        if scheme.bits != 8:
            raise QuantkitError(
                f"--embedding-layout {UNPACKED} stores a byte per weight, and --quantize-embedding {self.scheme} has "
                f"{scheme.bits}-bit codes; use --quantize-embedding int8 (or the packed layout)"
            )
        return replace(scheme, unpacked=True)


class _Hooks(Hooks):
    def prepare(self, config: Any, job: JobView) -> None:
        scheme = config.resolved
        if scheme is None:
            return
        if not job.unties_head and head_is_tied(job.source, f"{job.arch.lm_head_path}.weight", job.weights):
            raise QuantkitError(
                f"--quantize-embedding needs an untied embedding, and '{job.model}' ties its head to it (the head "
                "would be quantized too, which vLLM's quantized embedding cannot serve); add --rotate hadamard "
                "(which unties them) or drop --quantize-embedding"
            )
        hidden = int(config_json(job.source)["hidden_size"])
        problem = layout_problem(scheme, hidden) or embedding_problem(scheme)
        if problem is not None:
            raise QuantkitError(f"--quantize-embedding {config.scheme}: {problem}")
        if config.solver == "gptq" and job.calibration_ids is None:
            raise QuantkitError(
                "--embedding-solver gptq sums its Fisher over calibration windows, and this run is data-free; use "
                "a calibrated method (e.g. --method gptq) or --embedding-solver rtn"
            )

    def final_tensors(
        self, config: Any, job: JobView, work: WorkView, outer: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor | None]:
        scheme = config.resolved
        if scheme is None:
            return {}
        name = f"{job.arch.embed_path}.weight"
        table = outer[name] if name in outer else job.weights.get(name)
        if config.solver == "gptq":
            quantized = _gptq_embedding(table, scheme, config.fisher_windows, job)
        else:
            quantized = quantize_rtn(table, scheme, scale_dtype=job.storage)
        return {name: None, **linear_tensors(job.arch.embed_path, quantized, job.storage)}

    def outer_schemes(self, config: Any, job: JobView) -> dict[str, QuantScheme]:
        scheme = config.resolved
        return {} if scheme is None else {job.arch.embed_path: scheme}


def _gptq_embedding(table: torch.Tensor, scheme: QuantScheme, windows: int, job: JobView) -> QuantizedWeight:
    """The table solved by GPTQ (act-order in static groups, so the stored groups are the plain ones) under the
    Fisher of the first residual stream, taken in the source's basis and turned into the run's (``Q^T F Q``)."""
    ids = job.calibration_ids
    assert ids is not None  # prepare refuses a data-free run
    fisher = residual_fisher(job.source, job.arch, job.weights, ids[:windows], job.forward_dtype)
    basis = job.residual_basis
    if basis is not None:
        fisher = basis.double().T @ fisher @ basis.double()
    hessian = (fisher / fisher.diagonal().mean()).float()  # GPTQ's damping is relative: only the shape matters
    solved = quantize_head(table.float(), replace(scheme, act_order=True, static_groups=True), job.storage, hessian)
    assert solved.g_idx is None  # static groups: the layout the scheme writes
    return replace(solved, scheme=scheme)


SWITCH = Switch("field", field="scheme", off=OFF)
CAPS = Capabilities(needs_calibration=False)
SUMMARY = "embedding quantization: the untied token table written quantized (round-to-nearest)"
ALGORITHM = register("embed_quant", EmbedQuantConfig, Role.HEAD, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
