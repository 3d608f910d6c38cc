"""Wall time of each stage of the engine step, accumulated over the engine's life (read by `quantkit bench`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# In step order: choose the batch, draft tokens (speculation), build input tensors, run the model, sample and
# verify drafts, then record tokens, detokenize and apply stop conditions.
STAGES = ("schedule", "propose", "prepare", "forward", "sample", "postprocess")


@dataclass(slots=True)
class StepProfile:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    steps: int = 0

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.steps = 0
