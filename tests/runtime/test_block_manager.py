"""BlockManager: reference counting, free list, prefix cache; checked against a fake KV cache."""

from __future__ import annotations

import random

import pytest

import quantkit.runtime.block_manager as bm_mod
from quantkit.errors import QuantkitError
from quantkit.runtime.block_manager import BlockManager, block_hash
from quantkit.runtime.sequence import Sequence

BS = 4


class FakeKV:
    """Token ids stand in for K/V: writing position p stores token_ids[p] in its slot; reads must agree."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[tuple[int, int], int] = {}

    def compute(self, seq: Sequence, n: int) -> None:
        bs = self.bm.block_size
        start = seq.num_computed_tokens
        assert 1 <= n <= seq.num_tokens - start
        for p in range(start, start + n):
            block_id = seq.block_table[p // bs]
            assert self.bm.ref_count(block_id) == 1, "wrote into a shared block"
            self.slots[(block_id, p % bs)] = seq.token_ids[p]
        context = [self.slots.get((seq.block_table[p // bs], p % bs)) for p in range(start + n)]
        assert context == seq.token_ids[: start + n], "KV read back differs from the sequence's tokens"
        seq.num_computed_tokens += n
        self.bm.cache_computed_blocks(seq)


def prefill(bm: BlockManager, kv: FakeKV, seq: Sequence, next_token: int | None = None) -> None:
    bm.allocate(seq)
    kv.compute(seq, seq.num_uncomputed_tokens)
    if next_token is not None:
        seq.append_token(next_token)


def test_randomized_ops_keep_invariants() -> None:
    hits = 0
    for seed in range(60):
        rng = random.Random(seed)
        bm = BlockManager(num_blocks=rng.randint(6, 24), block_size=BS, enable_prefix_caching=seed % 5 != 0)
        kv = FakeKV(bm)
        bases = [[rng.randrange(3) for _ in range(16)] for _ in range(3)]
        live: list[Sequence] = []
        for _ in range(250):
            op = rng.random()
            if op < 0.3 or not live:
                prompt = rng.choice(bases)[: rng.randint(0, 16)] + [rng.randrange(3) for _ in range(rng.randint(1, 6))]
                seq = Sequence(prompt)
                free_before = bm.num_free_blocks
                if bm.can_allocate(seq):
                    bm.allocate(seq)
                    hits += seq.num_cached_tokens > 0
                    assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < seq.num_tokens
                    assert len(seq.block_table) == seq.num_blocks(BS)
                    assert bm.num_free_blocks <= free_before
                    live.append(seq)
                else:
                    with pytest.raises(RuntimeError):
                        bm.allocate(seq)
                    assert bm.num_free_blocks == free_before and not seq.block_table
            elif op < 0.85:
                seq = rng.choice(live)
                if seq.num_uncomputed_tokens > 1:  # a prefill chunk
                    kv.compute(seq, rng.randint(1, seq.num_uncomputed_tokens))
                    if seq.num_uncomputed_tokens == 0:  # prefill done: sample the first token
                        seq.append_token(rng.randrange(3))
                elif bm.can_append(seq):  # a decode step
                    bm.may_append(seq)
                    kv.compute(seq, 1)
                    seq.append_token(rng.randrange(3))
                else:
                    assert bm.num_free_blocks == 0 and len(seq.block_table) < seq.num_blocks(BS)
            else:
                seq = live.pop(rng.randrange(len(live)))
                bm.deallocate(seq)
                assert not seq.block_table
            bm.check_invariants(live)
        for seq in live:
            bm.deallocate(seq)
        bm.check_invariants([])
        assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0
        assert all(b.ref_count == 0 for b in bm.blocks)
    assert hits > 50  # the workload really exercised prefix sharing


def test_prefix_hit_shares_blocks_and_different_prefix_does_not() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    kv = FakeKV(bm)
    a = Sequence(list(range(10)))
    prefill(bm, kv, a, next_token=50)
    b = Sequence([*range(8), 99, 98])
    bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_count(i) for i in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] not in a.block_table and bm.ref_count(b.block_table[2]) == 1
    kv.compute(b, b.num_uncomputed_tokens)  # reads the shared KV back correctly
    # Same second block, different first block: the hash chain keeps them apart.
    c = Sequence([9, 9, 9, 9, 4, 5, 6, 7, 1])
    bm.allocate(c)
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(a.block_table)
    bm.check_invariants([a, b, c])


def test_block_registered_only_once_computed() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    kv = FakeKV(bm)
    a = Sequence(list(range(12)))
    bm.allocate(a)
    kv.compute(a, 5)  # chunked prefill: only block 0 is fully computed
    assert bm.num_cached_tokens(Sequence(list(range(12)))) == 4
    kv.compute(a, 7)
    assert bm.num_cached_tokens(Sequence(list(range(12)))) == 8  # the last block is always recomputed
    assert bm.num_cached_tokens(Sequence(list(range(13)))) == 12


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    kv = FakeKV(bm)
    a = Sequence(list(range(8)))
    prefill(bm, kv, a, next_token=1)
    b = Sequence(list(range(8)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.num_uncomputed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    kv.compute(b, 4)
    c = Sequence([*range(8), 5])  # one more token: both full blocks hit, only the last token is computed
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.num_uncomputed_tokens == 1
    bm.check_invariants([a, b, c])


def test_freed_cached_blocks_are_revived_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    kv = FakeKV(bm)
    a = Sequence(list(range(9)))
    prefill(bm, kv, a)
    old = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and all(bm.ref_count(i) == 0 for i in old)
    b = Sequence(list(range(9)))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == old[:2] and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 1
    kv.compute(b, 1)
    bm.deallocate(b)
    # Fill the whole cache with unrelated tokens: the cached blocks get evicted and reused.
    c = Sequence([7] * 16)
    prefill(bm, kv, c)
    assert sorted(c.block_table) == [0, 1, 2, 3]
    bm.deallocate(c)
    d = Sequence(list(range(9)))
    bm.allocate(d)
    assert d.num_cached_tokens == 0
    kv.compute(d, 9)
    bm.check_invariants([d])


def test_lru_evicts_tail_blocks_before_shared_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    kv = FakeKV(bm)
    a = Sequence(list(range(13)))  # blocks 0-3, the first 3 full and cached
    prefill(bm, kv, a)
    bm.deallocate(a)  # freed tail first: the free list is now 4, 5, 6, 7, 3, 2, 1, 0
    prefill(bm, kv, Sequence(list(range(50, 63))))  # takes the never-used blocks 4-7
    filler = Sequence([60, 61, 62, 63, 64])  # takes a's blocks 3 and 2 (tail first)
    prefill(bm, kv, filler)
    assert sorted(filler.block_table) == [2, 3]
    assert bm.num_cached_tokens(Sequence(list(range(13)))) == 8  # blocks 0 and 1 survived


def test_hash_collision_never_shares_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_mod, "block_hash", lambda prev, tokens, salt=None: b"same")
    bm = BlockManager(num_blocks=8, block_size=BS)
    kv = FakeKV(bm)
    a = Sequence([1, 2, 3, 4, 5])
    prefill(bm, kv, a)
    b = Sequence([4, 3, 2, 1, 5])  # same (fake) hash, different tokens
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table)
    kv.compute(b, 5)
    bm.check_invariants([a, b])


def test_block_hash_is_stable() -> None:
    h = bm_mod.block_hash(None, [1, 2, 3, 4])
    assert h == bm_mod.block_hash(None, [1, 2, 3, 4]) and len(h) == 16
    assert h != bm_mod.block_hash(None, [1, 2, 3, 5])
    assert bm_mod.block_hash(h, [1, 2, 3, 4]) != h
    assert h.hex() == bm_mod.block_hash(None, [1, 2, 3, 4]).hex()


def test_can_allocate_exactly_when_blocks_suffice() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    kv = FakeKV(bm)
    assert bm.can_allocate(Sequence(list(range(100, 116))))  # 16 tokens: 4 blocks
    assert not bm.can_allocate(Sequence(list(range(100, 117))))  # 17 tokens: 5 blocks
    a = Sequence(list(range(9)))  # 3 blocks, 2 full
    prefill(bm, kv, a)
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(Sequence([*range(8), 42]))  # 2 in-use hits + 1 new block
    assert not bm.can_allocate(Sequence([*range(8), 42, 43, 44, 45, 46]))  # needs 2 new blocks
    assert not bm.can_allocate(Sequence(list(range(100, 105))))  # no hits: 2 new blocks
    assert bm.can_allocate(Sequence([100]))
    bm.deallocate(a)
    big = Sequence([*range(8), 42, 43, 44, 45, 46])  # 2 revived + 2 new = the whole cache
    assert bm.can_allocate(big)
    bm.allocate(big)
    assert big.num_cached_tokens == 8 and bm.num_free_blocks == 0
    bm.check_invariants([big])


def test_can_append_only_at_block_boundary() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    kv = FakeKV(bm)
    a = Sequence([1, 2, 3])
    prefill(bm, kv, a, next_token=4)  # 4 tokens: the decode slot is in block 0
    b = Sequence([5])
    prefill(bm, kv, b, next_token=6)
    assert bm.num_free_blocks == 0 and bm.can_append(a)
    bm.may_append(a)
    kv.compute(a, 1)
    a.append_token(7)  # 5 tokens: the next decode needs a second block, none is free
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError):
        bm.may_append(a)
    bm.deallocate(b)
    assert bm.can_append(a)
    bm.may_append(a)
    assert len(a.block_table) == 2 and bm.usage == 1.0
    bm.check_invariants([a])


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    kv = FakeKV(bm)
    a = Sequence(list(range(9)))
    prefill(bm, kv, a)
    b = Sequence(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_check_invariants_detects_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match="owners"):
        bm.check_invariants([])  # a's blocks are referenced but no table holds them
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError):
        bm.check_invariants([a])
    bm.blocks[a.block_table[0]].ref_count -= 1
    b = Sequence([9])
    b.block_table = [a.block_table[1]]  # double ownership without a reference
    with pytest.raises(AssertionError):
        bm.check_invariants([a, b])


def test_bad_sizes_rejected() -> None:
    with pytest.raises(QuantkitError, match="num_blocks=0"):
        BlockManager(0, 16)
    with pytest.raises(QuantkitError, match="block_size=0"):
        BlockManager(4, 0)


def test_a_cache_salt_separates_prefixes() -> None:
    """Issue #39: the prefix cache is shared by all clients unless salted; a salt is part of the first block's hash,
    so the chain: only sequences with the same salt share blocks (vLLM's cache_salt)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence(list(range(13)), cache_salt=b"tenant-a")
    bm.allocate(a)
    a.num_computed_tokens = 13
    bm.cache_computed_blocks(a)
    assert bm.num_cached_tokens(Sequence(list(range(13)), cache_salt=b"tenant-a")) == 12
    assert bm.num_cached_tokens(Sequence(list(range(13)), cache_salt=b"tenant-b")) == 0
    assert bm.num_cached_tokens(Sequence(list(range(13)))) == 0
    assert block_hash(None, [1, 2, 3, 4]) == block_hash(None, [1, 2, 3, 4], None)  # unsalted hashes are unchanged
    assert block_hash(None, [1, 2, 3, 4], b"s") != block_hash(None, [1, 2, 3, 4])
