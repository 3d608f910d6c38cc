"""One request's token state, as the scheduler and the block manager see it (no tensors).

Token accounting, for a sequence with ``num_tokens`` tokens (prompt + generated so far):

* ``num_cached_tokens``: tokens whose KV came from the prefix cache at the latest allocation (a multiple
  of the block size, always < ``num_tokens``); kept after the sequence finishes, for usage reporting.
* ``num_computed_tokens``: tokens whose KV is in the cache *before* the current step. The runner computes
  positions ``[num_computed_tokens, num_computed_tokens + n)`` for the ``n`` tokens it was scheduled.
  While decoding, ``num_computed_tokens == num_tokens - 1``: the step computes the last token and
  samples the next one.
* ``num_draft_tokens``: during a speculative step only (between ``Scheduler.add_drafts`` and ``postprocess``),
  drafted tokens sit at the end of ``token_ids`` so that blocks and input positions cover them; verification
  removes them and appends the accepted ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from quantkit.runtime.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed on this request


@dataclass(slots=True, eq=False)  # identity equality: deque.remove must find this very sequence
class Sequence:
    token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower is admitted first among its tenant's waiting requests (vLLM's `priority`)
    tenant: str = ""  # who sent it (an API key's name): the waiting queue is shared fairly between tenants
    cache_salt: bytes | None = None  # mixed into its prefix-cache hashes: only requests with the same salt share
    seq_id: int = field(default_factory=lambda: next(_seq_ids), init=False)
    num_prompt_tokens: int = field(default=0, init=False)
    status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_hashed_blocks: int = field(default=0, init=False)  # leading blocks registered in the prefix cache
    block_table: list[int] = field(default_factory=list, init=False)
    arrival: int = field(default=-1, init=False)  # stamped by Scheduler.add; kept across preemption
    num_draft_tokens: int = field(default=0, init=False)  # drafts at the end of token_ids, under verification

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)  # own copy: the prompt list stays the caller's
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def reads_prefix_cache(self) -> bool:
        """False for a request that scores its prompt: every prompt position must run through the model (its
        computed blocks are still registered for later requests)."""
        return self.sampling_params.prompt_logprobs is None

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled (1 when decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold the KV of all current tokens."""
        return -(-len(self.token_ids) // block_size)

    def last_block_num_tokens(self, block_size: int) -> int:
        """Tokens in the last (possibly partial) logical block; 0 for an empty sequence."""
        return len(self.token_ids) - (self.num_blocks(block_size) - 1) * block_size if self.token_ids else 0

    def block(self, i: int, block_size: int) -> list[int]:
        """Token ids of logical block ``i``."""
        if not 0 <= i < self.num_blocks(block_size):
            raise IndexError(f"block {i} out of range for {self.num_blocks(block_size)} blocks")
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
