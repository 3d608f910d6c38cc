"""Owns the model and the KV cache; turns a SchedulerOutput into input tensors and last-position logits.

For a sequence scheduled with ``n`` tokens, positions are ``[num_computed_tokens, num_computed_tokens + n)`` and
position ``p`` lives in cache slot ``block_table[p // block_size] * block_size + p % block_size``. Index tensors
are built once per step from Python lists; only the rows whose logits are needed (each sequence's last
scheduled token, and the prompt positions a request scores) go through the LM head. A hybrid model's linear-attention
layers keep no KV pages: each sequence's state lives in the slot ``state_slot`` names (:mod:`.state_slots`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from quantkit.errors import QuantkitError
from quantkit.runtime.attention_backend import AttentionBackend, AttentionMetadata
from quantkit.runtime.deltanet import GatedDeltaNet
from quantkit.runtime.kv_cache import KVCache, bytes_per_block
from quantkit.runtime.kv_stored_scales import resolve_kv_cache_dtype, stored_kv_scales
from quantkit.runtime.layers import Attention
from quantkit.runtime.logprobs import TokenLogprob, token_logprobs
from quantkit.runtime.model import CausalLM
from quantkit.runtime.scheduler import SchedulerOutput
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.state_slots import RecurrentStates

ModelInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]
SCORE_CHUNK = 256  # rows of [rows, vocab] fp32 logits scored at a time (a 150k vocab: 154 MB)


class ScoredRows(NamedTuple):
    """Rows of a step's flattened tokens to score: the token each row's logits score, and how many of the most
    likely tokens to list there."""

    rows: list[int]
    targets: list[int]
    ks: list[int]


def _attentions(model: CausalLM) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def model_kv_scales(model: CausalLM) -> torch.Tensor | None:
    """The checkpoint's calibrated KV scales, float32 ``[2, L, Hkv]`` (None when it has no kv_cache_scheme)."""
    return stored_kv_scales(_attentions(model), model.config.num_kv_heads)


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block (all layers, K and V; 8-bit storage counts its float16 per-row scales, a cache under
    the checkpoint's scales has none)."""
    cfg = model.config
    stored = model_kv_scales(model) is not None
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, stored)
    return bytes_per_block(
        len(_attentions(model)),
        block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        kv_cache_dtype,
        row_scales=not stored,
    )


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        state_slot: Callable[[Sequence], int] | None = None,
        num_state_slots: int = 0,
    ) -> None:
        cfg = model.config
        self.model, self.backend, self.block_size = model, backend, block_size
        self.device = model.model.embed_tokens.weight.device
        stored = model_kv_scales(model)  # a checkpoint's calibrated FP8 cache replaces computed scales
        attentions = _attentions(model)  # a hybrid's linear-attention layers keep no KV (state slots instead)
        self.cache = KVCache(
            len(attentions),
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            resolve_kv_cache_dtype(kv_cache_dtype, stored is not None),
            self.device,
            stored_scales=stored,
        )
        self.kv_cache = self.cache.values  # [2, L, num_blocks, block_size, Hkv, D]; scales in self.cache.scales
        for i, attn in enumerate(attentions):
            attn.kv, attn.backend = self.cache.layer(i), backend
        # hybrid models: each running sequence's linear-attention state, in the slot ``state_slot`` gives it
        self.state_slot, self.states = state_slot, None
        deltanets = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        if deltanets and cfg.linear_attention is not None:
            if state_slot is None or num_state_slots < 1:
                raise QuantkitError(
                    f"{cfg.model_type} has linear-attention layers, whose per-sequence state only the Engine's "
                    "StateSlotBlockManager provides; it cannot be a draft model: pick a draft without them"
                )
            self.states = RecurrentStates(len(deltanets), num_state_slots, cfg.linear_attention, dtype, self.device)
            for i, layer in enumerate(deltanets):
                layer.state = self.states.layer(i)

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence], context_lens: list[int]) -> torch.Tensor:
        width = max(-(-c // self.block_size) for c in context_lens)
        rows = [s.block_table[:width] + [0] * (width - min(width, len(s.block_table))) for s in seqs]
        return self._tensor(rows, torch.int32)

    def prepare(self, out: SchedulerOutput) -> ModelInputs:
        """(input_ids, positions, attention metadata, index of each sequence's last row)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ctx_lens: list[int] = []
        last: list[int] = []
        for seq, n in zip(out.seqs, out.num_tokens, strict=True):
            start, table = seq.num_computed_tokens, seq.block_table
            end = start + n
            if n == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            ctx_lens.append(end)
            last.append(len(ids) - 1)
        block_tables = self._block_tables(out.seqs, ctx_lens)
        context_lens = self._tensor(ctx_lens, torch.int32)
        # A decode step where some sequence verifies drafts runs several queries for it: the prefill attention path
        multi_query = out.is_prefill or len(ids) > len(out.seqs)
        decode_mask = None
        if not multi_query:  # shared by every layer's decode attention
            keys = torch.arange(block_tables.shape[1] * bs, device=self.device)
            decode_mask = (keys[None, :] < context_lens[:, None])[:, None, None, :]
        meta = AttentionMetadata(
            is_prefill=multi_query,
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=block_tables,
            context_lens=context_lens,
            query_lens=list(out.num_tokens),
            context_lens_list=ctx_lens,
            decode_mask=decode_mask,
            state_slots=[self.state_slot(s) for s in out.seqs] if self.state_slot is not None else None,
        )
        pos = self._tensor(positions, torch.int64)
        return self._tensor(ids, torch.int64), pos, meta, self._tensor(last, torch.int64)

    def forward(self, out: SchedulerOutput, inputs: ModelInputs) -> torch.Tensor:
        """fp32 logits: prefill, ``[B, vocab]`` at each sequence's last token; decode, ``[T, vocab]`` at every
        scheduled token (one per sequence, or its last token and drafts in order when it verifies drafts)."""
        return self.forward_scored(out, inputs, None)[0]

    @torch.inference_mode()
    def forward_scored(
        self, out: SchedulerOutput, inputs: ModelInputs, scored: ScoredRows | None
    ) -> tuple[torch.Tensor, list[TokenLogprob]]:
        """:meth:`forward`'s logits, and with ``scored`` the log-probabilities of ``scored.targets`` at the given rows
        of the step's flattened tokens (prompt scoring), computed :data:`SCORE_CHUNK` rows at a time so that a long
        prompt never holds a ``[tokens, vocab]`` logits tensor. Without ``scored`` this costs nothing extra."""
        input_ids, positions, meta, last = inputs
        hidden = self.model(input_ids, positions, meta)
        scores: list[TokenLogprob] = []
        if scored is not None:
            for lo in range(0, len(scored.rows), SCORE_CHUNK):
                part = slice(lo, lo + SCORE_CHUNK)
                logits = self.model.compute_logits(hidden[self._tensor(scored.rows[part], torch.int64)])
                scores += token_logprobs(logits, scored.targets[part], scored.ks[part])
        return self.model.compute_logits(hidden[last] if out.is_prefill else hidden), scores

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        return self.forward(out, self.prepare(out))
