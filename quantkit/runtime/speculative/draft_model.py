"""Draft-model drafting: a smaller model with the same tokenizer proposes K tokens autoregressively.

The draft keeps its own paged KV cache and one mirror :class:`Sequence` per target sequence. A mirror's
``num_computed_tokens`` counts the leading tokens whose draft KV matches the target's tokens; after verification
it is cut back to the accepted prefix (rolled back), and its tail blocks are freed. Drafting for a batch is one
catch-up pass (the tokens the target accepted since the last draft, usually 1 or 2 per sequence) and K - 1
single-token passes, all batched across sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.format.files import read_checkpoint_config
from quantkit.model.resolve import resolve_model
from quantkit.runtime.attention_backend import AttentionBackend
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.model import ModelConfig, load_model
from quantkit.runtime.model_runner import ModelRunner
from quantkit.runtime.sampler import processed_probs
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import SchedulerOutput
from quantkit.runtime.sequence import Sequence


@dataclass(slots=True)
class DraftRequest:
    seq: Sequence  # the target sequence (decoding: its last token is not computed yet)
    k: int  # tokens to draft
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] draft distributions for sampled requests; None for greedy ones


class DraftModel:
    def __init__(
        self,
        spec: str | Path,
        *,
        target_vocab_size: int,
        target_tokenizer: Any,
        max_model_len: int,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        path = resolve_model(spec)
        cfg = ModelConfig.from_hf(read_checkpoint_config(path))
        _check_compatible(path, cfg, target_vocab_size, target_tokenizer, max_model_len)
        self.model = load_model(path, dtype=dtype, device=device, max_positions=max_model_len)
        self.runner = ModelRunner(self.model, backend, num_blocks, block_size, dtype)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._mirrors: dict[int, Sequence] = {}

    def propose(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        """Drafts by target seq_id; a sequence whose mirror cannot get blocks gets none this step."""
        active: list[tuple[DraftRequest, Sequence]] = []
        for req in requests:
            mirror = self._sync(req.seq)
            if self.block_manager.reserve(mirror, req.seq.num_tokens + req.k - 1):  # the drafts' KV included
                active.append((req, mirror))
        drafts = {req.seq.seq_id: Draft([], None) for req, _ in active}
        probs: dict[int, list[torch.Tensor]] = {req.seq.seq_id: [] for req, _ in active}
        for round_ in range(max((req.k for req, _ in active), default=0)):
            batch = [(req, m) for req, m in active if req.k > round_]
            mirrors = [m for _, m in batch]
            counts = [m.num_tokens - m.num_computed_tokens for m in mirrors]
            logits = self.runner.run(SchedulerOutput(mirrors, any(n > 1 for n in counts), counts))
            for (req, mirror), n, row in zip(batch, counts, logits, strict=True):
                mirror.num_computed_tokens += n
                token, dist = _draw(row, req.params, req.generator)
                drafts[req.seq.seq_id].tokens.append(token)
                if dist is not None:
                    probs[req.seq.seq_id].append(dist)
                if req.k > round_ + 1:  # the last draft is never fed back to the draft model
                    mirror.token_ids.append(token)
        for seq_id, rows in probs.items():
            if rows:
                drafts[seq_id].probs = torch.stack(rows)
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of ``seq``, holding its tokens; draft KV kept for the longest prefix still valid."""
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self._mirrors[seq.seq_id] = Sequence(seq.token_ids)
        valid = 0
        limit = min(mirror.num_computed_tokens, seq.num_tokens - 1)
        while valid < limit and mirror.token_ids[valid] == seq.token_ids[valid]:
            valid += 1
        mirror.token_ids = list(seq.token_ids)
        mirror.num_computed_tokens = valid  # roll back past the first rejected draft
        if mirror.block_table:
            self.block_manager.trim(mirror)
        return mirror

    def forget(self, live: set[int]) -> None:
        """Free the mirrors of sequences that finished or were aborted."""
        for seq_id in [s for s in self._mirrors if s not in live]:
            self.block_manager.deallocate(self._mirrors.pop(seq_id))


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, Any]:
    """The draft token: argmax for greedy requests; else a sample from the processed distribution (returned)."""
    if params.greedy:
        return int(logits.argmax()), None
    dist = processed_probs(logits[None], [params])[0]
    return int(torch.multinomial(dist, 1, generator=generator)), dist


def _check_compatible(
    path: Path, cfg: ModelConfig, target_vocab_size: int, target_tokenizer: Any, max_model_len: int
) -> None:
    from quantkit.model.resolve import load_tokenizer

    if cfg.vocab_size != target_vocab_size:
        raise QuantkitError(
            f"the draft model's vocabulary has {cfg.vocab_size} tokens and the target's {target_vocab_size}; "
            "use a draft model with the same tokenizer"
        )
    if target_tokenizer is not None:
        try:
            draft_vocab = load_tokenizer(path).get_vocab()
        except QuantkitError:
            draft_vocab = None
        if draft_vocab is not None and draft_vocab != target_tokenizer.get_vocab():
            raise QuantkitError(
                "the draft model's tokenizer differs from the target's (other token ids for the same text); "
                "use a draft model with the same tokenizer"
            )
    if cfg.max_position_embeddings < max_model_len:
        raise QuantkitError(
            f"the draft model handles {cfg.max_position_embeddings} positions but max_model_len is {max_model_len}; "
            "lower max_model_len or use another draft model"
        )
