"""Counters of speculative decoding over the engine's life (for /metrics and `quantkit bench`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpeculationStats:
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # draft tokens the target accepted
    verify_steps: int = 0  # target forward passes of one sequence with drafts (one per sequence and step)
    emitted: int = 0  # tokens those passes produced (accepted drafts + one token from the target each)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per target forward pass of a sequence with drafts (1.0 would be no gain)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def reset(self) -> None:
        self.drafted = self.accepted = self.verify_steps = self.emitted = 0
