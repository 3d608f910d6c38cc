"""One request's completion as text: decoded as tokens arrive, cut at stop strings, streamed in final pieces.

Contract of :meth:`Detokenizer.update`, called with the completion's token ids so far (new ones appended):

- ``text`` is ``tokenizer.decode(token_ids, skip_special_tokens=True)``: the whole completion decoded at once,
  because decoding token by token does not concatenate (a byte-level token may hold part of a UTF-8 character,
  and tokenizers space or merge tokens by context). An incomplete last character decodes as U+FFFD until its
  last byte arrives.
- Stop strings are searched in that text, so one spread over several tokens is found. Each update searches only
  from ``len(longest stop) - 1`` characters before the previous update's end (that end counts an incomplete
  character's U+FFFD, so a longest stop string ending in a character split across updates is missed: a known
  bug, kept as the engine had it). When any is found, ``text`` is cut before the earliest match (the stop string
  is not part of the output), ``stopped`` is True, and later updates return that same text with an empty delta.
- ``delta`` is the text that became final in this update. Until the last update it holds back a trailing U+FFFD
  (a character still incomplete) and the last ``len(longest stop) - 1`` characters (they may begin a stop
  string); the last update (``finished``, or a stop string found) releases the rest. So the deltas concatenate
  to the final ``text``, provided decoding more tokens only appends to the text decoded before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_INCOMPLETE = "\ufffd"  # what a decoder yields for a UTF-8 character whose bytes have not all arrived


class TextDecoder(Protocol):
    """The one tokenizer method used (a Hugging Face tokenizer has it)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class Detokenized:
    """The result of one :meth:`Detokenizer.update`."""

    text: str  # the completion so far, cut before the earliest stop string once one is found
    delta: str  # text that became final in this update
    stopped: bool  # a stop string was found (in this update or an earlier one)


class Detokenizer:
    """Decodes one completion as it grows and applies its stop strings (see the module docstring)."""

    def __init__(self, tokenizer: TextDecoder, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=1)
        self.text = ""
        self.stopped = False
        self._checked = 0  # length of the text already searched for stop strings (before any cut)
        self._sent = 0  # length of the text already returned in deltas

    def update(self, token_ids: Sequence[int], finished: bool = False, search: bool = True) -> Detokenized:
        """Decode ``token_ids`` (the whole completion so far); ``finished``: no more tokens will come; ``search``
        False: stop strings are not looked for in this update's new text (vLLM's ``min_tokens``: a stop string that
        ends before the minimum is reached never stops the request)."""
        if self.stopped:
            return Detokenized(self.text, "", True)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if self.stop:
            start = max(0, self._checked - self._longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0] if search else []
            self._checked = len(text.rstrip(_INCOMPLETE))  # a half-decoded character is searched again
            if hits:
                text, self.stopped = text[: min(hits)], True
        self.text = text
        final = finished or self.stopped
        end = len(text) if final else len(text.rstrip(_INCOMPLETE)) - (self._longest - 1)  # hold back the tail
        delta = text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return Detokenized(text, delta, self.stopped)
