"""The error of one quantizable unit (a stage's linears) under every candidate, solved as ``quantize`` solves.

Modes (see :mod:`quantkit.mixed.sensitivity`): ``proxy`` the Hessian-weighted error tr(dW H dW^T) summed over
the unit's linears; ``kl`` the final-logit KL with only this unit quantized; ``hybrid`` the proxy errors rescaled
so the lowest-bit candidate's error equals its measured KL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.eval.logit_metrics import token_kl
from quantkit.format.engines import layout_problem
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.mixed.candidates import unit_storage_bits
from quantkit.mixed.measurement import CandidateCost, UnitMeasurement
from quantkit.model.architectures import ArchSpec, Stage
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.quantization.solvers.gptq import GPTQSettings, gptq_solve, hessian_weighted_error
from quantkit.quantization.solvers.grid import row_stack


@dataclass(slots=True)
class KLReference:
    """The float model (fully loaded) with its logits on a few windows, and the current block's input for them."""

    model: nn.Module
    reference: torch.Tensor  # [w, T, V] float32 logits
    hidden: torch.Tensor  # [w, T, H] float32 input of the current block

    def kl_with(self, modules: list[nn.Module], weights: list[torch.Tensor], index: int, arch: ArchSpec) -> float:
        """Mean KL of the final distribution with ``modules`` of block ``index`` temporarily holding ``weights``."""
        originals = [m.weight.data for m in modules]
        layers = get_module(self.model, arch.layers_path)
        seq_len = self.hidden.shape[1]
        runner = BlockRunner.for_model(self.model, arch, seq_len, batch_size=self.hidden.shape[0])
        try:
            for m, w in zip(modules, weights, strict=True):
                m.weight.data = w
            with torch.inference_mode():
                hidden = self.hidden
                for layer in list(layers)[index:]:
                    hidden = runner(layer, hidden)
                norm = get_module(self.model, arch.final_norm_path)
                logits = get_module(self.model, arch.lm_head_path)(norm(hidden))
            return float(token_kl(self.reference, logits.float()).mean())
        finally:
            for m, w in zip(modules, originals, strict=True):
                m.weight.data = w


def unit_name(prefix: str, linears: tuple[str, ...]) -> str:
    if len(linears) == 1:
        return f"{prefix}.{linears[0]}"
    parent = linears[0].rpartition(".")[0]
    return f"{prefix}.{parent}." + "+".join(name.rpartition(".")[2] for name in linears)


def loadable_candidates(
    schemes: dict[str, QuantScheme | None], in_features: list[int]
) -> dict[str, QuantScheme | None]:
    """The candidates whose layout every engine loads for a unit with these in-features (fp16 always)."""
    return {
        name: scheme
        for name, scheme in schemes.items()
        if scheme is None or all(layout_problem(scheme, k) is None for k in in_features)
    }


def solve_unit(
    weights: list[torch.Tensor],
    hessian: torch.Tensor,
    scheme: QuantScheme,
    gptq: GPTQSettings,
    storage: torch.dtype,
    name: str,
) -> list[QuantizedWeight]:
    """A unit's linears solved as ``quantize --method gptq`` solves a stage, on the scheme's own grid (integer, FP8,
    FP4): row-stacked into one matrix, so that a scale every row shares (NVFP4's global scale) is one for the fused
    projection, as the checkpoint stores it and vLLM serves it; integer rows come out as one linear at a time."""
    stacked, rows = row_stack(weights, scheme)
    result = gptq_solve(stacked, hessian, scheme, gptq, scale_dtype=storage, name=name, overwrite=True)
    return [result.weight.rows(part) for part in rows]


@dataclass(slots=True)
class UnitMeter:
    """Measures units: the candidates (name -> scheme with the run's solver options; None: fp16), how they are
    solved, the storage dtype (scales are stored in it), the mode and, for kl/hybrid, the KL reference."""

    arch: ArchSpec
    schemes: dict[str, QuantScheme | None]
    gptq: GPTQSettings
    storage: torch.dtype
    mode: str
    kl: KLReference | None = None

    def measure(
        self, block: nn.Module, prefix: str, index: int, stage: Stage, hessian: torch.Tensor
    ) -> UnitMeasurement:
        modules = [get_module(block, name) for name in stage.linears]
        shapes = [(m.out_features, m.in_features) for m in modules]
        scale_bits = self.storage.itemsize * 8
        schemes = loadable_candidates(self.schemes, [k for _, k in shapes])
        options = {
            name: CandidateCost(error=0.0, bits=unit_storage_bits(scheme, shapes, scale_bits=scale_bits))
            for name, scheme in schemes.items()
        }
        quantized = [name for name, scheme in schemes.items() if scheme is not None]
        anchor = min(quantized, key=lambda n: options[n].bits) if self.mode == "hybrid" and quantized else None
        kl_scale = 1.0
        for candidate in quantized:
            weights = [m.weight.data for m in modules]
            scheme = schemes[candidate]
            assert scheme is not None  # fp16 is not solved
            unit = solve_unit(weights, hessian, scheme, self.gptq, self.storage, f"{prefix}.{stage.name}")
            solved = [part.dequantize() for part in unit]
            if self.mode == "kl":
                options[candidate].error = self._kl(modules, solved, index)
                continue
            pairs = zip(modules, solved, strict=True)
            proxy = float(sum(hessian_weighted_error(m.weight.data, w, hessian) for m, w in pairs))
            options[candidate].error = proxy
            if candidate == anchor:
                kl_scale = self._kl(modules, solved, index) / proxy if proxy > 0 else 0.0
        for candidate in quantized:
            options[candidate].error *= kl_scale
        return UnitMeasurement(
            name=unit_name(prefix, stage.linears),
            modules=[f"{prefix}.{n}" for n in stage.linears],
            params=sum(n * k for n, k in shapes),
            options=options,
        )

    def _kl(self, modules: list[nn.Module], weights: list[torch.Tensor], index: int) -> float:
        assert self.kl is not None, f"mode {self.mode} needs the KL reference"
        return self.kl.kl_with(modules, weights, index, self.arch)
