"""``quantkit bench --profile trace.json``: the run under ``torch.profiler`` (CPU activities), written as a Chrome
trace (open it in https://ui.perfetto.dev or chrome://tracing). Each engine step is an ``engine.step`` span and each
stage of its :class:`StepProfile` inside it an ``engine.<stage>`` span."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantkit.atomic import write_atomically
from quantkit.runtime.engine import Engine
from quantkit.runtime.step_profile import StepProfile


@dataclass(slots=True)
class LabelledStepProfile(StepProfile):
    """A StepProfile whose stages are also ``record_function`` spans."""

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function

        with record_function(f"engine.{name}"), StepProfile.stage(self, name):
            yield


@contextlib.contextmanager
def chrome_trace(engine: Engine, path: Path) -> Iterator[None]:
    """Profile the block and write its trace to ``path`` (atomically); the engine's stages are labelled within."""
    from torch.profiler import ProfilerActivity, profile

    original = engine.profile
    engine.profile = labelled = LabelledStepProfile()
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            yield
    finally:
        original.seconds, original.steps = labelled.seconds, labelled.steps
        engine.profile = original
    write_atomically(Path(path), lambda tmp: prof.export_chrome_trace(str(tmp)))
