"""When to draft for a sequence: drafting pays only while drafts are accepted, so a sequence whose acceptance
stays low stops drafting for a while (exponential back-off), and free-form text is not slowed down."""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the latest step in the acceptance average
LOW_ACCEPTANCE = 0.3  # below this average, the sequence pauses drafting
FIRST_PAUSE, MAX_PAUSE = 4, 64  # decode steps without drafts after low acceptance (doubling up to the max)


@dataclass(slots=True)
class _State:
    acceptance: float = 1.0  # smoothed fraction of drafts accepted
    pause: int = 0  # steps left without drafting
    next_pause: int = FIRST_PAUSE


class DraftPolicy:
    def __init__(self) -> None:
        self._states: dict[int, _State] = {}

    def allows(self, seq_id: int) -> bool:
        """Whether to draft for the sequence this step (a paused one counts down instead)."""
        state = self._states.setdefault(seq_id, _State())
        if state.pause > 0:
            state.pause -= 1
            return False
        return True

    def record(self, seq_id: int, drafted: int, accepted: int) -> None:
        state = self._states.setdefault(seq_id, _State())
        state.acceptance += SMOOTHING * (accepted / drafted - state.acceptance)
        if state.acceptance < LOW_ACCEPTANCE:
            state.pause, state.next_pause = state.next_pause, min(2 * state.next_pause, MAX_PAUSE)
            state.acceptance = 2 * LOW_ACCEPTANCE  # a fresh chance after the pause
        elif state.acceptance > 0.6:
            state.next_pause = FIRST_PAUSE

    def forget(self, live: set[int]) -> None:
        for seq_id in [s for s in self._states if s not in live]:
            del self._states[seq_id]
