"""Head refit: after the last block, the float head is refitted to read the quantized model's final hidden states
as it reads the float model's (:mod:`quantkit.quantization.solvers.head_refit` has the math and the reasons). It
needs a head of its own: an untied one, or the one a rotation unties."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.model.source_weights import config_json, head_is_tied
from quantkit.quantization.methods.hooks import Hooks, JobView, WorkView
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.solvers.head_refit import refit_head


@dataclass(frozen=True)
class HeadRefitConfig:
    # a larger ridge pulls the map towards 0, not towards the identity (docs/benchmarks.md has the sweep)
    ridge: float = option(1e-4, "Ridge added to the Gram matrix, relative to its mean diagonal.", cli=False)

    def __post_init__(self) -> None:
        if not self.ridge >= 0:
            raise QuantkitError(f"head refit ridge must be >= 0, got {self.ridge}")


class _Hooks(Hooks):
    def prepare(self, config: Any, job: JobView) -> None:
        """Without a rotation the source's head must be its own (a rotation unties it)."""
        if not job.unties_head and head_is_tied(job.source, f"{job.arch.lm_head_path}.weight", job.weights):
            raise QuantkitError(
                f"--refit-head needs an untied head, and '{job.model}' ties its head to the embedding; "
                "add --rotate hadamard (which unties it) or drop --refit-head"
            )

    def final_tensors(
        self, config: Any, job: JobView, work: WorkView, outer: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The head tensor to write, refitted to the finished run's last activations (computed from the run's own
        head each time, so a resumed run writes the same head)."""
        arch = job.arch
        head_name, norm_name = f"{arch.lm_head_path}.weight", f"{arch.final_norm_path}.weight"
        head = outer[head_name] if head_name in outer else job.weights.get(head_name)
        norm = outer[norm_name] if norm_name in outer else job.weights.get(norm_name)
        reference = work.load_reference()
        if reference is None:
            raise QuantkitError(f"{work.path} has no float activations to refit the head to; rerun without --resume")
        eps = float(config_json(job.source).get("rms_norm_eps", 1e-6))
        return {head_name: refit_head(head, work.load_hidden(), reference, norm, eps, config.ridge)}


SWITCH = Switch(
    "flag",
    flag="--refit-head",
    help="Refit the float head to the quantized body (needs an untied head, or --rotate).",
)
CAPS = Capabilities(needs_float_path=True)
SUMMARY = "head refit: the float head refitted to read the quantized body's final hidden states"
ALGORITHM = register("head_refit", HeadRefitConfig, Role.HEAD, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
