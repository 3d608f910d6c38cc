"""What the engine hands back: each request's state between steps, its text (detokenized, cut at stop strings), its
log-probabilities, and one :class:`RequestOutput` per request that got a token (or finished) in a step.

The engine's step is schedule -> run -> postprocess; this is the postprocess side after the scheduler has appended
the step's tokens. Stop strings are applied token by token (:meth:`OutputProcessor.process`), so several tokens
appended in one step (accepted drafts) stop exactly where one-token steps would have. Log-probabilities are scored
from the step's logits (:mod:`quantkit.runtime.logprobs`) and recorded here, in prompt / completion order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.runtime.detokenizer import Detokenizer
from quantkit.runtime.logprobs import TokenLogprob, token_logprobs
from quantkit.runtime.model_runner import ScoredRows
from quantkit.runtime.scheduler import Scheduler, SchedulerOutput
from quantkit.runtime.sequence import FinishReason, Sequence


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step (``finished`` once it is done); ``token_ids`` are the completion's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the request failed or was refused (finish_reason ERROR)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0  # time.perf_counter() stamps
    first_scheduled_time: float | None = None  # admitted from the waiting queue (its queue time ends)
    first_token_time: float | None = None
    finish_time: float | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing scores it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per completion token


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    seq: Sequence
    prompt: str | None
    generator: torch.Generator | None  # per-request seed; kept across preemption
    arrival_time: float
    detokenizer: Detokenizer | None  # None: the model has no tokenizer (no text)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    text: str = ""
    finish_time: float | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by prefill steps, in prompt order
    logprobs: list[TokenLogprob] | None = None  # appended as tokens are sampled (trimmed to the completion on output)


class OutputProcessor:
    """The live requests (by sequence id and by request id) and everything the engine returns about them."""

    def __init__(self, tokenizer: Any, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer  # None: no text, no stop strings
        self.scheduler = scheduler  # a stop string finishes its sequence
        self.stream_text = False  # decode text every step (streaming); else only at the end or for stop strings
        self._by_seq: dict[int, RequestState] = {}
        self._by_id: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def add(self, request_id: str, seq: Sequence, prompt: str | list[int], generator: torch.Generator | None) -> None:
        params = seq.sampling_params
        detok = Detokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None
        text_prompt = prompt if isinstance(prompt, str) else None
        req = RequestState(request_id, seq, text_prompt, generator, time.perf_counter(), detok)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        if params.logprobs is not None:
            req.logprobs = []
        self._by_seq[seq.seq_id] = self._by_id[request_id] = req

    def mark_scheduled(self, seqs: list[Sequence]) -> None:
        """Stamp the first time each sequence was scheduled (its queue time ends there)."""
        now = time.perf_counter()
        for seq in seqs:
            req = self._by_seq.get(seq.seq_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = now

    def request_ids(self) -> list[str]:
        """Every live request's id."""
        return list(self._by_id)

    def request_id(self, seq: Sequence) -> str:
        return self._by_seq[seq.seq_id].request_id

    def generator(self, seq: Sequence) -> torch.Generator | None:
        return self._by_seq[seq.seq_id].generator

    def remove(self, request_id: str) -> Sequence | None:
        """Forget a request (aborted); its sequence, or None when it is unknown or already finished."""
        req = self._by_id.pop(request_id, None)
        if req is None:
            return None
        self._by_seq.pop(req.seq.seq_id, None)
        return req.seq

    # ----------------------------------------------------------------- log-probabilities
    def prompt_rows(self, out: SchedulerOutput) -> tuple[ScoredRows | None, list[RequestState]]:
        """The rows of a prefill step that score prompt tokens not scored yet (position ``p`` scores token ``p + 1``),
        and the request each belongs to; (None, []) when no request in the step scores its prompt."""
        rows: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        owners: list[RequestState] = []
        offset = 0
        for seq, n in zip(out.seqs, out.num_tokens, strict=True):
            req = self._by_seq[seq.seq_id]
            k = seq.sampling_params.prompt_logprobs
            if req.prompt_logprobs is not None and k is not None:
                start = seq.num_computed_tokens
                # scored already: tokens [0, len); a re-prefill after preemption scores nothing again
                first, end = max(start, len(req.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)
                rows += range(offset + first - start, offset + end - start)
                targets += seq.token_ids[first + 1 : end + 1]
                ks += [k] * max(0, end - first)
                owners += [req] * max(0, end - first)
            offset += n
        return (ScoredRows(rows, targets, ks), owners) if rows else (None, [])

    @staticmethod
    def record_prompt_logprobs(owners: list[RequestState], scores: list[TokenLogprob]) -> None:
        for req, score in zip(owners, scores, strict=True):
            req.prompt_logprobs.append(score)  # type: ignore[union-attr]

    def score(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        """Record the log-probability of each sampled token (row ``r`` of ``logits`` scored ``tokens[r]``)."""
        ks = [s.sampling_params.logprobs or 0 for s in seqs]
        for seq, score in zip(seqs, token_logprobs(logits, tokens, ks), strict=True):
            self._by_seq[seq.seq_id].logprobs.append(score)  # type: ignore[union-attr]

    # ----------------------------------------------------------------- outputs
    def process(self, seqs: list[Sequence], tokens: list[list[int]], sizes: list[int]) -> list[RequestOutput]:
        """After the scheduler appended ``tokens``: ``sizes`` is each sequence's token count before that."""
        now = time.perf_counter()
        outputs = []
        for seq, new, size in zip(seqs, tokens, sizes, strict=True):
            req = self._by_seq.get(seq.seq_id)
            if req is None or not (new or seq.is_finished):  # a finished prefill-only request has no new token
                continue
            if req.first_token_time is None and new:
                req.first_token_time = now
            self._detokenize(req, size)
            if seq.is_finished:
                req.finish_time = now
                self._forget(req)
            outputs.append(self._output(req))
        return outputs

    def fail(self, seq: Sequence, error: str) -> RequestOutput:
        """The final output of a request whose batch failed (its sequence already finished with ERROR)."""
        req = self._by_seq[seq.seq_id]
        self._forget(req)
        req.error, req.finish_time = error, time.perf_counter()
        return self._output(req)

    def _forget(self, req: RequestState) -> None:
        del self._by_seq[req.seq.seq_id]
        del self._by_id[req.request_id]

    def _detokenize(self, req: RequestState, size_before: int) -> None:
        """Decode the completion; with stop strings, token by token, so several tokens appended in one step
        (accepted drafts) stop exactly where one-token steps would have, and the tokens after are dropped."""
        seq, detok = req.seq, req.detokenizer
        # without stop strings, text is needed only at the end, or every step when streaming
        if detok is None or (not detok.stop and not seq.is_finished and not self.stream_text):
            return
        ends = range(size_before + 1, len(seq) + 1) if detok.stop else [len(seq)]
        min_tokens = seq.sampling_params.min_tokens
        for end in ends:
            last = end == len(seq)
            completion = seq.token_ids[seq.num_prompt_tokens : end]
            result = detok.update(completion, finished=last and seq.is_finished, search=len(completion) > min_tokens)
            req.text = result.text
            if result.stopped:
                del seq.token_ids[end:]  # tokens after the stop string's end were never to be generated
                if seq.is_finished:
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(seq, FinishReason.STOP)
                return

    @staticmethod
    def _output(req: RequestState) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.completion_token_ids,
            text=req.text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            error=req.error,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            prompt_logprobs=req.prompt_logprobs,
            logprobs=req.logprobs[: seq.num_completion_tokens] if req.logprobs is not None else None,
        )
