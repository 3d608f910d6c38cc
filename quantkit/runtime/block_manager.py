"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and a prefix cache.

Prefix caching: once every token of a FULL block has its KV computed, the block is registered under a
chained hash ``blake2b(previous block's hash || this block's token ids)``, so a hash names the whole
prefix up to and including that block. A sequence's ``cache_salt`` (vLLM's) is mixed into its first block's hash,
so the whole chain: requests with different salts never share blocks, and the time to first token of one tenant's
request tells nothing about another tenant's prompts. A later sequence whose leading full blocks hash the same
(and whose token ids compare equal: no false sharing on a collision) reuses those blocks with a
reference count > 1. Blocks are registered only once their KV is *computed* (``cache_computed_blocks``,
called by the scheduler after each step), never at allocation: a chunked prefill must not hand out
blocks whose KV is not written yet.

A block whose reference count drops to 0 goes back to the free list but keeps its hash, so a later
prefix hit can revive it until the allocator hands it out for something else. The free list is
LRU-ordered: blocks are taken from the front and freed to the back, a sequence's blocks tail-first,
so shared prefix blocks outlive the tails that hang off them.

The last prompt token is always computed (its logits give the first sampled token), so a prompt
whose full blocks are all cached still recomputes its whole last block into a fresh block: cached
tokens are capped at ``(num_tokens - 1) // block_size`` full blocks. Writing into a shared block is
never needed, and the prefix the runner reads back is never rewritten.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from quantkit.errors import QuantkitError
from quantkit.runtime.sequence import Sequence


def block_hash(prev_hash: bytes | None, token_ids: list[int], salt: bytes | None = None) -> bytes:
    """Stable chained hash of one full block (the same across processes and runs); ``salt`` for the first block."""
    h = hashlib.blake2b(digest_size=16)
    if prev_hash is not None:
        h.update(prev_hash)
    elif salt:
        h.update(b"salt" + struct.pack("<q", len(salt)) + salt)  # length-prefixed: no salt/token ambiguity
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] | None = None  # its tokens, to verify a hash hit

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = None
        self.token_ids = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise QuantkitError(f"num_blocks={num_blocks} is invalid; the KV cache needs at least 1 block")
        if block_size < 1:
            raise QuantkitError(f"block_size={block_size} is invalid; use a positive size such as 16")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # ordered set, LRU first
        self._hash_to_block: dict[bytes, int] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of full blocks, leaving at least the last token uncached."""
        if not (self.enable_prefix_caching and seq.reads_prefix_cache):
            return []
        hits: list[int] = []
        prev: bytes | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block(i, self.block_size)
            prev = block_hash(prev, tokens, seq.cache_salt)
            block_id = self._hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens ``allocate`` would take from the prefix cache right now."""
        return len(self._match_prefix(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._match_prefix(seq)
        # A hit on an in-use block costs nothing; a hit on a free cached block revives it (costs one free block).
        in_use_hits = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return seq.num_blocks(self.block_size) - in_use_hits <= len(self._free)

    def can_append(self, seq: Sequence) -> bool:
        return max(0, seq.num_blocks(self.block_size) - len(seq.block_table)) <= len(self._free)

    # ----------------------------------------------------------------- mutations
    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing the longest cached prefix."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"not enough free blocks for sequence {seq.seq_id}; check can_allocate first")
        hits = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]  # revive a freed, still-cached block
            block.ref_count += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(seq.num_blocks(self.block_size) - len(hits))]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)

    def may_append(self, seq: Sequence) -> None:
        """Make room for the token the next decode step computes (a new block at a block boundary)."""
        while len(seq.block_table) < seq.num_blocks(self.block_size):
            if not self._free:
                raise RuntimeError(f"no free block to append to sequence {seq.seq_id}; check can_append first")
            seq.block_table.append(self._take_free_block())
        self.cache_computed_blocks(seq)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Append free blocks until the sequence has room for ``num_tokens`` tokens; False (and nothing taken)
        when too few are free. For a draft model's mirror sequences, which grow by drafts before their tokens."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > len(self._free):
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(need))
        return True

    def trim(self, seq: Sequence) -> None:
        """Free the tail blocks the sequence no longer needs (those that held rejected drafts). They hold no
        computed token, so they never carry a hash."""
        keep = seq.num_blocks(self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.reset()
                self._free[block.block_id] = None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every full block whose KV is computed (call after ``seq.num_computed_tokens`` advances)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_hashed_blocks, num_full):
            prev = self.blocks[seq.block_table[i - 1]].hash if i > 0 else None
            tokens = seq.block(i, self.block_size)
            block = self.blocks[seq.block_table[i]]
            block.hash = block_hash(prev, tokens, seq.cache_salt)
            block.token_ids = tuple(tokens)
            self._register(block)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def _register(self, block: Block) -> None:
        """Map the block's hash to it; the newest copy wins and an older duplicate becomes unmapped."""
        assert block.hash is not None
        old = self._hash_to_block.get(block.hash)
        if old is not None and old != block.block_id and self.blocks[old].ref_count == 0:
            self.blocks[old].hash = self.blocks[old].token_ids = None  # free and unreachable: a plain free block
        self._hash_to_block[block.hash] = block.block_id

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching 0 go to the back of the free list, tail first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None and self._hash_to_block.get(block.hash) != block_id:
                    block.hash = block.token_ids = None  # an unmapped duplicate can never be hit again
                self._free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = 0  # num_cached_tokens stays for usage reporting

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
            del self._hash_to_block[block.hash]  # evicted from the prefix cache
        block.reset()
        block.ref_count = 1
        return block_id

    # ----------------------------------------------------------------- checks
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise ``AssertionError`` unless the bookkeeping agrees with the live sequences' block tables."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            table = seq.block_table
            _require(len(set(table)) == len(table), f"seq {seq.seq_id}: a block appears twice in {table}")
            lo, hi = self.blocks_needed(seq.num_tokens - 1), seq.num_blocks(self.block_size)
            _require(not table or lo <= len(table) <= hi, f"seq {seq.seq_id}: {len(table)} blocks for {seq.num_tokens}")
            for block_id in table:
                _require(0 <= block_id < self.num_blocks, f"seq {seq.seq_id}: block id {block_id} out of range")
                owners[block_id] += 1
            for i, block_id in enumerate(table):  # exactly the leading hashed blocks carry a hash, and their tokens
                block = self.blocks[block_id]
                if i < seq.num_hashed_blocks:
                    _require(block.token_ids == tuple(seq.block(i, self.block_size)), f"block {block_id}: wrong tokens")
                else:
                    _require(block.hash is None, f"seq {seq.seq_id}: unregistered block {block_id} carries a hash")
        for block in self.blocks:
            i = block.block_id
            _require(block.ref_count == owners[i], f"block {i}: ref_count {block.ref_count} != {owners[i]} owners")
            in_free = i in self._free
            _require(
                (block.ref_count == 0) == in_free, f"block {i}: ref_count {block.ref_count}, in free list {in_free}"
            )
            _require((block.hash is None) == (block.token_ids is None), f"block {i}: hash without tokens")
        _require(len(self._free) == len(set(self._free)), "a block appears twice in the free list")
        _require(sum(1 for b in self.blocks if b.ref_count > 0) + len(self._free) == self.num_blocks, "blocks lost")
        for h, i in self._hash_to_block.items():
            block = self.blocks[i]
            _require(block.hash == h, f"hash map points to block {i}, whose hash differs")
            _require(len(block.token_ids or ()) == self.block_size, f"cached block {i} is not full")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
