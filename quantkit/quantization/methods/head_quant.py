"""Head quantization (``--quantize-head``): the head written as a quantized Linear, solved after the last block on
the final hidden states the run has already computed (GPTQ on their Hessian, or round-to-nearest).

It needs a head of its own: an untied one, or the one a rotation unties. A head tied to the embedding is one
matrix with two uses; quantizing it would quantize the embedding too, which vLLM's quantized embedding (a lookup
only) cannot serve as a head (``quantkit.format.engines`` records the rule). It runs after a head refit, so the
refitted head is the one quantized. The checkpoint names the head in its own config group (``lm_head``: an exact
name, which wins over the body's ``Linear`` target in compressed-tensors, transformers and vLLM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.format.engines import layout_problem
from quantkit.format.outer_engines import head_problem
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.model.source_weights import config_json, head_is_tied
from quantkit.quantization.methods.hooks import Hooks, JobView, WorkView
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.solvers.gptq import gptq_solve
from quantkit.quantization.solvers.grid import quantize_rtn
from quantkit.quantization.solvers.head_refit import final_hidden

OFF = "none"
HEAD_SOLVERS = ("gptq", "rtn")
_SPELLING = re.compile(r"^w(?P<bits>[2348])(?:g(?P<group>\d+))?$")


def head_scheme(spelling: str, solver: str = "gptq") -> QuantScheme | None:
    """The head's scheme from its spelling: ``int8`` (= ``w8``, per channel), ``w<bits>`` (per channel) or
    ``w<bits>g<group>``, symmetric (vLLM's WNA16 kernels and its quantized embeddings take symmetric weights);
    ``none``: a float head. GPTQ solves it with act-order in static groups and a Hessian-weighted range search."""
    text = spelling.strip().lower()
    if text == OFF:
        return None
    match = _SPELLING.match("w8" if text == "int8" else text)
    if match is None or match["group"] == "0":
        raise QuantkitError(
            f"unknown head scheme '{spelling}'; use none, int8, w<bits> (per channel) or w<bits>g<group>, "
            "e.g. --quantize-head w4g64"
        )
    gptq = solver == "gptq"
    group = int(match["group"]) if match["group"] else -1
    return QuantScheme(int(match["bits"]), group, True, act_order=gptq, static_groups=True, mse_clip=True)


@dataclass(frozen=True)
class HeadQuantConfig:
    scheme: str = option(
        OFF,
        "Quantize the (untied) head: none, int8 (per channel), w4g64, w<bits> or w<bits>g<group>; a head tied to the "
        "embedding needs --rotate hadamard (which unties it).",
        flag="--quantize-head",
    )
    solver: str = option("gptq", "Head solver: gptq (on the final hidden states) or rtn.", flag="--head-solver")

    def __post_init__(self) -> None:
        if self.solver not in HEAD_SOLVERS:
            raise QuantkitError(f"unknown head solver '{self.solver}'; use one of {', '.join(HEAD_SOLVERS)}")
        head_scheme(self.scheme, self.solver)  # the spelling is checked now, before any work

    @property
    def resolved(self) -> QuantScheme | None:
        return head_scheme(self.scheme, self.solver)


def head_hessian(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 ``2 X^T X / n`` of the head's input X (the final norm of each window's last hidden states), summed a
    window at a time in float64."""
    size = hidden.shape[-1]
    gram, count = torch.zeros(size, size, dtype=torch.float64), 0
    for window in hidden:
        x = final_hidden(window.cpu(), norm_weight.cpu(), eps).double()
        gram += x.T @ x
        count += x.shape[0]
    return (2 * gram / max(count, 1)).float()


def quantize_head(
    head: torch.Tensor, scheme: QuantScheme, storage: torch.dtype, hessian: torch.Tensor | None
) -> QuantizedWeight:
    """The head [V, H] quantized: GPTQ under ``hessian``, or round-to-nearest without one."""
    if hessian is None:
        return quantize_rtn(head, scheme, scale_dtype=storage)
    return gptq_solve(head.float(), hessian, scheme, _HEAD_GPTQ, scale_dtype=storage, name="lm_head").weight


@dataclass(frozen=True)
class _HeadGPTQ:  # GPTQ's own defaults (quantkit.quantization.methods.gptq): the head has no options of its own
    damp: float = 0.01
    block_size: int = 128
    damp_retries: int = 3
    damp_growth: float = 10.0


_HEAD_GPTQ = _HeadGPTQ()


class _Hooks(Hooks):
    def prepare(self, config: Any, job: JobView) -> None:
        """Refused up front: a tied head without a rotation, or a group that does not divide the hidden size."""
        scheme = config.resolved
        head = f"{job.arch.lm_head_path}.weight"
        if scheme is None:
            return
        tied = not job.unties_head and head_is_tied(job.source, head, job.weights)
        if head_problem(scheme, tied) is not None:  # the engine rule (quantkit.format.outer_engines)
            raise QuantkitError(
                f"--quantize-head needs an untied head, and '{job.model}' ties its head to the embedding "
                "(quantizing it would change the embedding too); add --rotate hadamard (which unties it) or drop "
                "--quantize-head"
            )
        hidden = int(config_json(job.source)["hidden_size"])
        problem = layout_problem(scheme, hidden)
        if problem is not None:
            raise QuantkitError(f"--quantize-head {config.scheme}: the head's {problem}; use a group that divides it")

    def final_tensors(
        self, config: Any, job: JobView, work: WorkView, outer: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor | None]:
        """The head's packed tensors, and ``None`` for its float weight (written in their place)."""
        scheme = config.resolved
        if scheme is None:
            return {}
        arch = job.arch
        head_name, norm_name = f"{arch.lm_head_path}.weight", f"{arch.final_norm_path}.weight"
        head = outer[head_name] if head_name in outer else job.weights.get(head_name)
        hessian = None
        if config.solver == "gptq":
            norm = outer[norm_name] if norm_name in outer else job.weights.get(norm_name)
            eps = float(config_json(job.source).get("rms_norm_eps", 1e-6))
            hessian = head_hessian(work.load_hidden(), norm, eps)
        quantized = quantize_head(head, scheme, job.storage, hessian)
        return {head_name: None, **linear_tensors(arch.lm_head_path, quantized, job.storage)}

    def outer_schemes(self, config: Any, job: JobView) -> dict[str, QuantScheme]:
        scheme = config.resolved
        return {} if scheme is None else {job.arch.lm_head_path: scheme}


SWITCH = Switch("field", field="scheme", off=OFF)
CAPS = Capabilities(needs_calibration=True)
SUMMARY = "head quantization: the untied head written quantized, solved on the final hidden states"
ALGORITHM = register("head_quant", HeadQuantConfig, Role.HEAD, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
