"""The engine's speculative-decoding stage: draft for a decode batch, then verify the target's logits."""

from __future__ import annotations

import torch

from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.draft_model import Draft, DraftModel, DraftRequest
from quantkit.runtime.speculative.ngram import propose_ngram
from quantkit.runtime.speculative.policy import DraftPolicy
from quantkit.runtime.speculative.stats import SpeculationStats
from quantkit.runtime.speculative.verify import verify_greedy, verify_sampled


class Speculator:
    def __init__(self, num_tokens: int, max_model_len: int, draft_model: DraftModel | None = None) -> None:
        self.num_tokens = num_tokens  # K
        self.max_model_len = max_model_len
        self.draft_model = draft_model  # None: n-gram drafting
        self.policy = DraftPolicy()
        self.stats = SpeculationStats()

    def budget(self, seq: Sequence) -> int:
        """Drafts worth proposing: the step adds accepted drafts + 1 token, within max_tokens and the context; none
        for a request whose logits logit_bias or min_tokens change."""
        params = seq.sampling_params
        if params.logit_bias or seq.num_completion_tokens < params.min_tokens:
            return 0  # verification compares raw target logits: requests that change them are not speculated
        room = min(params.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.num_tokens, room))

    def propose(
        self, seqs: list[Sequence], generators: list[torch.Generator | None], live: set[int]
    ) -> dict[int, Draft]:
        """Drafts by seq_id for the sequences of a decode batch (none for a paused or finishing sequence)."""
        self.forget(live)
        wanted = [(s, g, self.budget(s)) for s, g in zip(seqs, generators, strict=True)]
        wanted = [(s, g, k) for s, g, k in wanted if k > 0 and self.policy.allows(s.seq_id)]
        if self.draft_model is None:
            drafts = {s.seq_id: Draft(propose_ngram(s.token_ids, k), None) for s, _, k in wanted}
            return {seq_id: d for seq_id, d in drafts.items() if d.tokens}
        requests = [DraftRequest(s, k, s.sampling_params, g) for s, g, k in wanted]
        return self.draft_model.propose(requests)

    def forget(self, live: set[int]) -> None:
        """Drop the state of sequences that are gone (finished or aborted): the draft cache's blocks too."""
        self.policy.forget(live)
        if self.draft_model is not None:
            self.draft_model.forget(live)

    def verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor, generator: torch.Generator | None) -> list[int]:
        """Tokens to append for ``seq`` from its ``k + 1`` rows of target logits; updates stats and the policy."""
        drafts = draft.tokens
        if seq.sampling_params.greedy:
            tokens = verify_greedy(drafts, logits)
        else:
            tokens = verify_sampled(drafts, logits, seq.sampling_params, generator, draft.probs)
        accepted = len(tokens) - 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += accepted
        self.stats.verify_steps += 1
        self.stats.emitted += len(tokens)
        self.policy.record(seq.seq_id, len(drafts), accepted)
        return tokens
