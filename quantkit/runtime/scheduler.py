"""Continuous-batching scheduler: admission, prefill/decode batches, preemption by recompute.

Each step is either a prefill batch or a decode batch (``SchedulerOutput.is_prefill``):

* Prefill first: sequences with a chunked prefill in progress, then new ones from ``waiting`` in the order of
  :class:`~quantkit.runtime.waiting_queue.WaitingQueue` (preempted first, then fair between tenants, by priority
  and arrival within one; strict: if the next one does not fit, nothing is admitted behind it), bounded by
  ``max_num_seqs`` running sequences, ``max_num_batched_tokens`` uncached tokens and free blocks.
  A prefill allocates blocks for the whole sequence even when only a chunk of it runs this step.
* Otherwise every running sequence decodes one token, oldest arrival first. One that cannot get a
  block for its next token preempts the most recently arrived running sequence of the tenant holding the most
  (with one tenant: the most recently arrived, or itself when it is the newest): the victim's blocks are freed
  and it goes back to the front of ``waiting`` with its generated tokens, so it is later re-prefilled as
  prompt + generated-so-far (its full blocks are usually still in the prefix cache). A preempted sequence keeps
  its arrival stamp and so its priority.
* Fair shares: when the next waiting sequence does not fit (batch full, or too few free blocks) and another tenant
  runs more than one sequence more than its tenant, that tenant's newest running sequence yields (preempted back
  into its tenant's queue), so that a tenant that filled the batch while nobody else waited gives way as soon as
  others arrive.

The caller loop is ``out = schedule()``; run the model on ``out``; ``postprocess(out.seqs, sampled)``.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sequence import FinishReason, Sequence, SequenceStatus
from quantkit.runtime.waiting_queue import WaitingQueue


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # running sequences at most
    max_num_batched_tokens: int = 2048  # tokens per step at most
    max_model_len: int = 2048  # prompt + completion at most
    enable_chunked_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QuantkitError(f"{name}={value!r} is invalid; use an integer >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise QuantkitError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len="
                f"{self.max_model_len}, so a long prompt could never be prefilled; raise max_num_batched_tokens "
                "to at least max_model_len or enable chunked prefill"
            )


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool
    num_tokens: list[int]  # tokens to compute per sequence: a chunk when prefilling, 1 when decoding
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step (for metrics)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, eos_token_id: int | Iterable[int] | None
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.waiting = WaitingQueue()
        self.running: deque[Sequence] = deque()
        self._seqs: dict[int, Sequence] = {}  # live (unfinished) sequences by id
        self._in_flight: dict[int, int] = {}  # seq_id -> tokens scheduled by the last schedule()
        self._arrivals = itertools.count()

    # ----------------------------------------------------------------- state
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    # ----------------------------------------------------------------- admission
    def add(self, seq: Sequence) -> None:
        """Queue a new request; one that could never run is rejected here, before it touches anything."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.seq_id in self._seqs:
            raise QuantkitError(f"sequence {seq.seq_id} was already added or has finished; create a new Sequence")
        seq.sampling_params.validate()
        prompt, max_tokens = seq.num_prompt_tokens, seq.sampling_params.max_tokens
        if prompt == 0:
            raise QuantkitError(f"request {seq.seq_id} has an empty prompt; pass at least one token")
        if prompt + max_tokens > self.config.max_model_len:
            raise QuantkitError(
                f"request {seq.seq_id}: prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {prompt + max_tokens} "
                f"exceeds max_model_len={self.config.max_model_len}; shorten the prompt or lower max_tokens"
            )
        # The KV of the final sampled token is never computed, so at most prompt + max_tokens - 1 tokens (the whole
        # prompt for a request that only scores it, max_tokens 0).
        need = self.block_manager.blocks_needed(prompt + max(max_tokens - 1, 0))
        if need > self.block_manager.num_blocks:
            raise QuantkitError(
                f"request {seq.seq_id} needs up to {need} KV blocks but the cache has only "
                f"{self.block_manager.num_blocks}; lower max_tokens or give the KV cache more memory"
            )
        seq.arrival = next(self._arrivals)
        self._seqs[seq.seq_id] = seq
        self.waiting.push(seq)

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            raise RuntimeError("schedule() called before postprocess() of the previous step")
        out = self._schedule_prefill()
        if out.is_empty:
            out = self._schedule_decode()
        self._in_flight = {s.seq_id: n for s, n in zip(out.seqs, out.num_tokens, strict=True)}
        return out

    def _schedule_prefill(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        seqs: list[Sequence] = []
        counts: list[int] = []
        budget = cfg.max_num_batched_tokens
        # 1. Continue chunked prefills in progress (they already hold their blocks).
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:
                n = min(seq.num_uncomputed_tokens, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        # 2. Admit waiting sequences in the queue's order; stop at the first that does not fit, unless a tenant holding
        # more than one sequence more than its tenant yields one (fair shares of the batch between tenants).
        running = Counter(s.tenant for s in self.running)
        yielded: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting.peek(running)
            assert seq is not None
            if len(self.running) >= cfg.max_num_seqs or not bm.can_allocate(seq):
                victim = self._over_share(running, seq.tenant, set(seqs))
                if victim is None:
                    break
                self._yield(victim, running)
                yielded.append(victim)
                continue
            uncached = seq.num_tokens - bm.num_cached_tokens(seq)
            if uncached > budget and not cfg.enable_chunked_prefill:
                break
            self.waiting.pop(seq)
            running[seq.tenant] += 1
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return SchedulerOutput(seqs, True, counts, yielded)

    def _over_share(self, running: Counter[str], tenant: str, busy: set[Sequence]) -> Sequence | None:
        """The newest running sequence (not in ``busy``) of the tenant running the most, if that is more than one
        more than ``tenant`` runs: it yields its slot and blocks to ``tenant``'s waiting sequence."""
        heavy, held = max(running.items(), key=lambda kv: kv[1], default=(tenant, 0))
        if held <= running[tenant] + 1:
            return None
        victims = [s for s in self.running if s.tenant == heavy and s not in busy]
        return max(victims, key=lambda s: s.arrival, default=None)

    def _yield(self, seq: Sequence, running: Counter[str]) -> None:
        """Preempt a running sequence for fairness: back into its tenant's queue (where its arrival puts it first)."""
        self.running.remove(seq)
        running[seq.tenant] -= 1
        self.block_manager.deallocate(seq)  # everything is recomputed (its full blocks stay in the prefix cache)
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    def _schedule_decode(self) -> SchedulerOutput:
        bm = self.block_manager
        pending = deque(sorted(self.running, key=lambda s: s.arrival))  # oldest first; victims from the back
        self.running.clear()
        batch: list[Sequence] = []
        preempted: list[Sequence] = []
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        held = Counter(s.tenant for s in pending)
        while pending and len(batch) < limit:
            seq = pending.popleft()
            while not bm.can_append(seq):
                # the newest sequence of the tenant holding the most (one tenant: the newest arrival)
                victim = max([*pending, seq], key=lambda s: (held[s.tenant], s.arrival))
                if victim is not seq:
                    pending.remove(victim)
                held[victim.tenant] -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.may_append(seq)
                batch.append(seq)
        self.running.extend(batch)
        self.running.extend(pending)  # over the batch limit: stay running, decode next step
        return SchedulerOutput(batch, False, [1] * len(batch), preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)  # resets num_computed_tokens: everything is recomputed
        seq.status = SequenceStatus.WAITING
        self.waiting.push_preempted(seq)  # later victims were pushed first, so they keep their arrival order

    # ----------------------------------------------------------------- speculation
    def add_drafts(self, out: SchedulerOutput, drafts: dict[int, list[int]]) -> None:
        """Schedule drafted tokens (by seq_id) behind each decoding sequence's last token, for one verifying pass.

        A sequence gets its drafts only if free blocks hold them: speculation never preempts anything.
        """
        if out.is_prefill:
            raise RuntimeError("drafts are verified in decode steps only")
        for i, seq in enumerate(out.seqs):
            tokens = drafts.get(seq.seq_id)
            if not tokens:
                continue
            seq.token_ids.extend(tokens)
            if not self.block_manager.can_append(seq):
                del seq.token_ids[-len(tokens) :]
                continue
            self.block_manager.may_append(seq)
            seq.num_draft_tokens = len(tokens)
            out.num_tokens[i] = self._in_flight[seq.seq_id] = 1 + len(tokens)

    # ----------------------------------------------------------------- results
    def postprocess(self, seqs: list[Sequence], token_ids: list[int] | list[list[int]]) -> list[Sequence]:
        """Record one step's results; return the sequences that finished in it.

        ``token_ids[i]`` is the token sampled for ``seqs[i]`` (or the list of tokens to append: the accepted
        drafts and the target's token, after verification); for a prefill chunk that does not reach the end of
        the sequence it is ignored (pass anything, e.g. -1 or []). An empty list at the end of a prefill finishes
        the sequence (LENGTH): a request with max_tokens 0, which only scores its prompt.
        """
        if len(seqs) != len(token_ids):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} sampled tokens")
        finished: list[Sequence] = []
        for seq, new in zip(seqs, token_ids, strict=True):
            n = self._in_flight.pop(seq.seq_id, None)
            tokens = new if isinstance(new, list) else [new]
            had_drafts = seq.num_draft_tokens > 0
            if had_drafts:  # verified: the drafts leave, the accepted ones come back below
                del seq.token_ids[-seq.num_draft_tokens :]
                seq.num_draft_tokens = 0
                n = len(tokens)  # the last token and the accepted drafts now have their KV
            if seq.is_finished:
                continue  # aborted while its step ran
            if n is None:
                raise RuntimeError(f"sequence {seq.seq_id} was not scheduled in the last step")
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                self.block_manager.cache_computed_blocks(seq)
                continue  # a chunk of a longer prefill: nothing sampled yet
            # A prefill-only request (max_tokens 0, scoring its prompt) samples nothing and is done.
            reason = FinishReason.LENGTH if not tokens else None
            for token_id in tokens:
                seq.append_token(token_id)
                reason = self._stop_reason(seq, token_id)
                if reason is not None:
                    break
            # A stop among accepted drafts drops the rest: no more computed tokens than tokens.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            self.block_manager.cache_computed_blocks(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif had_drafts:
                self.block_manager.trim(seq)  # blocks that held rejected drafts
        return finished

    def live_seq_ids(self) -> set[int]:
        return set(self._seqs)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.sampling_params
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a live sequence wherever it is and free its blocks (the engine's hook for stop strings)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        self._in_flight.pop(seq.seq_id, None)  # finished mid-step: postprocess will skip it
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._seqs.pop(seq.seq_id, None)

    def abort(self, seq_id: int) -> Sequence | None:
        """Cancel a request; returns it, or None when it is unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq
