"""Sampling one step's tokens: plain sampling for sequences whose prefill is complete, verification of drafts for
speculated ones; what a request asks for (logit_bias, min_tokens, extreme sampling values) fails only that request."""

from __future__ import annotations

import itertools
import logging

import torch

from quantkit.runtime.logits_processors import process_logits
from quantkit.runtime.output_processor import OutputProcessor
from quantkit.runtime.sampler import Sampler
from quantkit.runtime.scheduler import Scheduler, SchedulerOutput
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.draft_model import Draft
from quantkit.runtime.speculative.speculator import Speculator

_log = logging.getLogger("quantkit.runtime.engine")


class StepSampler:
    def __init__(
        self, sampler: Sampler, outputs: OutputProcessor, scheduler: Scheduler, speculator: Speculator | None
    ) -> None:
        self.sampler = sampler
        self.output_processor = outputs
        self.scheduler = scheduler
        self.speculator = speculator

    def __call__(
        self, out: SchedulerOutput, logits: torch.Tensor, drafts: dict[int, Draft]
    ) -> tuple[list[list[int]], dict[int, str]]:
        """Tokens to append per sequence: one sampled token; the verified drafts and one token after a
        speculative pass; none for a partial prefill chunk (which must not draw from a generator). Sequences that
        could not be sampled are returned by index, with why."""
        seqs, tokens = out.seqs, [[] for _ in out.seqs]
        failed: dict[int, str] = {}
        first = list(itertools.accumulate([0, *out.num_tokens]))  # logits row of each sequence's first token
        last_row = [first[i + 1] - 1 for i in range(len(seqs))] if not out.is_prefill else list(range(len(seqs)))
        done = [s.num_computed_tokens + n == len(s) for s, n in zip(seqs, out.num_tokens, strict=True)]
        # a prefill-only request (max_tokens 0) samples nothing
        plain = [
            i for i, s in enumerate(seqs) if done[i] and s.seq_id not in drafts and s.sampling_params.max_tokens > 0
        ]
        if plain:
            rows = [last_row[i] for i in plain]
            sub = logits if len(rows) == logits.shape[0] else logits[rows]
            sampled, bad = self._sample_rows(sub, [seqs[i] for i in plain])
            for j, i in enumerate(plain):
                if j in bad:
                    failed[i] = bad[j]
                else:
                    tokens[i] = [sampled[j]]
            scored = [j for j, i in enumerate(plain) if seqs[i].sampling_params.logprobs is not None and j not in bad]
            if scored:  # from the raw logits (vLLM's default raw_logprobs), not the processed ones
                self.output_processor.score(sub[scored], [seqs[plain[j]] for j in scored], [sampled[j] for j in scored])
        speculator = self.speculator
        assert speculator is not None or not drafts
        for i, seq in enumerate(seqs):
            if speculator is not None and seq.seq_id in drafts:
                generator = self.sampler.generator_for(self.output_processor.generator(seq))
                rows = logits[first[i] : first[i + 1]]
                try:
                    tokens[i] = speculator.verify(seq, drafts[seq.seq_id], rows, generator)
                except Exception as exc:
                    _log.exception("verifying the drafts of request %s failed", self.output_processor.request_id(seq))
                    failed[i] = f"{type(exc).__name__}: {exc}"
                    continue
                if seq.sampling_params.logprobs is not None:  # row j scored the j-th token appended
                    self.output_processor.score(rows[: len(tokens[i])], [seq] * len(tokens[i]), tokens[i])
        return tokens, failed

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], dict[int, str]]:
        """One token per row, sampled as one batch; if that raises, row by row, so that whatever a request asked
        for fails that request only. Failed rows: row -> why."""
        eos = self.scheduler.eos_token_ids
        gens = [self.output_processor.generator(s) for s in seqs]
        params = [s.sampling_params for s in seqs]
        try:
            tokens, failed = self.sampler.sample(process_logits(logits, seqs, eos), params, gens)
        except Exception:
            _log.exception("sampling a batch of %d failed; sampling its requests one by one", len(seqs))
            tokens, failed = [-1] * len(seqs), {}
            for j, seq in enumerate(seqs):
                try:
                    row, bad = self.sampler.sample(
                        process_logits(logits[j : j + 1], [seq], eos), [params[j]], [gens[j]]
                    )
                except Exception as exc:
                    row, bad = [-1], {0: f"{type(exc).__name__}: {exc}"}
                tokens[j] = row[0]
                if bad:
                    failed[j] = bad[0]
        for j, why in failed.items():
            _log.error("request %s could not be sampled: %s", self.output_processor.request_id(seqs[j]), why)
        return tokens, failed
