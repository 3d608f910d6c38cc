"""The expert stages of a mixture-of-experts block, run stage by stage by
:class:`~quantkit.model.staged_block.StagedBlock`.

Stage names (:meth:`~quantkit.model.architectures.ArchSpec.for_config`): ``gate_up`` reads the normalised
residual stream as a dense MLP's gate/up do; ``down.<e>`` reads expert ``e``'s activation ``act(gate(x)) * up(x)``,
``down.shared`` the shared expert's. With routed calibration (:meth:`ArchSpec.routed_stages`), ``gate_up.<e>``
reads only the rows routed to expert ``e``.

Calibration modes (``--moe-calibration``):

- ``all`` (default): every calibration token runs through every expert for the statistics (each expert's Hessian
  sees all rows), as llm-compressor's ``calibrate_all_experts`` does; an expert the router rarely picks still gets
  real statistics. Only the routed outputs go forward: the block's output is the block's own forward pass.
- ``routed``: each expert sees only the tokens routed to it, as at inference; an expert no token reaches has no
  statistics and is solved by round-to-nearest (recorded as a fallback).

Routing is counted once per block (tokens routed to each expert over the calibration set), on the residual stream
as the attention solved so far leaves it.
"""

from __future__ import annotations

import torch

from quantkit.model.architectures import DOWN, GATE_UP
from quantkit.model.moe import UnfusedMoE

ALL, ROUTED = "all", "routed"
MOE_CALIBRATION_MODES = (ALL, ROUTED)
SHARED = "shared"


def expert_stage(name: str) -> tuple[str, str] | None:
    """``("down", "3")`` for ``down.3``, ``("gate_up", "3")`` for ``gate_up.3``; None for a dense stage name."""
    kind, sep, key = name.partition(".")
    if not sep or kind not in (DOWN, GATE_UP):
        return None
    return kind, key


class ExpertInputs:
    """Inputs of an MoE block's expert linears, computed from the MLP's input ``x`` [b, T, H] (the normalised
    residual stream), and the routed-token counts."""

    def __init__(self, moe: UnfusedMoE, mode: str) -> None:
        if mode not in MOE_CALIBRATION_MODES:
            raise ValueError(f"unknown MoE calibration mode {mode!r}; use one of {MOE_CALIBRATION_MODES}")
        self.moe = moe
        self.mode = mode
        self.counts = torch.zeros(len(moe.expert_modules()), dtype=torch.int64)
        self.tokens = 0  # calibration tokens routed (each one to top-k experts)
        self.selected: tuple[int, torch.Tensor] | None = None  # the last routed selection: (expert, row mask)
        # another block's inputs whose routed selections this one takes over, batch by batch (the float block run
        # beside the quantized one: each expert's float moments on the very rows its Hessian sums)
        self.follow: ExpertInputs | None = None

    def count(self, x: torch.Tensor) -> None:
        """Add one mini-batch's routing to :attr:`counts` (call once per batch over the calibration set)."""
        flat = x.reshape(-1, x.shape[-1])
        self.counts += self.moe.routed_counts(flat).cpu()
        self.tokens += flat.shape[0]

    def _routed_rows(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """The rows of ``x`` [b, T, H] the router sends to ``expert``, as [n, H]."""
        flat = x.reshape(-1, x.shape[-1])
        if self.follow is not None:
            # the followed block selected this batch's rows for ``expert`` just before
            assert self.follow.selected is not None and self.follow.selected[0] == expert, "no selection to follow"
            mask = self.follow.selected[1]
        else:
            _, chosen = self.moe.route(flat)
            mask = (chosen == expert).any(dim=-1)
        self.selected = (expert, mask)
        return flat[mask]

    def gate_up(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Expert ``key``'s gate/up inputs: the rows routed to it (routed calibration only)."""
        return self._routed_rows(x, int(key))

    def down(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """down_proj's inputs of expert ``key`` (or of the shared expert): its activation on every row (``all``) or
        on the rows routed to it (``routed``; the shared expert always sees every row)."""
        if key == SHARED:
            shared = getattr(self.moe, self.moe.spec.shared_expert or "")
            return shared.act_fn(shared.gate_proj(x)) * shared.up_proj(x)
        expert = int(key)
        rows = x if self.mode == ALL else self._routed_rows(x, expert)
        return self.moe.expert_modules()[expert].activation(rows)

    def summary(self) -> dict[str, object]:
        """The block's routing over the calibration set, for the run log."""
        return {"mode": self.mode, "tokens": self.tokens, "routed_tokens": self.counts.tolist()}
