"""The block pool on the CPU: allocation, sharing, copy on write, eviction, no leaks."""

from __future__ import annotations

import pytest
import torch

from chatkv import block_pool as bp
from chatkv.block_pool import BlockPool
from chatkv.errors import OutOfBlocksError
from chatkv.sequence import Sequence


def make_pool(num_blocks: int = 8, block_size: int = 4) -> BlockPool:
    return BlockPool(num_blocks, block_size, num_layers=2, kv_heads=2, head_dim=4,
                     dtype=torch.float32, device="cpu", namespace="fp-test")


def fill(pool: BlockPool, seq: Sequence, tokens: list[int]) -> list[int]:
    """Pretend a forward pass computed ``tokens``: write a recognisable value per slot."""
    seq.token_ids.extend(tokens)
    slots = pool.prepare_write(seq, len(tokens))
    flat = pool.kv.view(2, 2, -1, 2, 4)
    for slot, tok in zip(slots, tokens):
        flat[:, :, slot] = float(tok)
    pool.commit(seq, len(tokens))
    return slots


def test_layout_and_bytes():
    pool = make_pool()
    assert pool.kv.shape == (2, 2, 8, 4, 2, 4)
    assert pool.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4
    assert pool.bytes_per_block == BlockPool.bytes_per_block_for(2, 2, 4, 4, torch.float32)


def test_slots_are_contiguous_within_blocks_and_release_restores_free_count():
    pool = make_pool()
    start = pool.num_available
    seq = Sequence()
    slots = fill(pool, seq, list(range(10)))
    assert len(seq.block_table) == 3
    assert slots[:4] == [seq.block_table[0] * 4 + i for i in range(4)]
    assert seq.num_computed == 10 and len(seq.block_hashes) == 2  # only full blocks are hashed
    pool.release(seq)
    assert pool.num_available == start
    assert pool.stats().used_blocks == 0


def test_shared_prefix_is_matched_and_refcounted():
    pool = make_pool()
    a = Sequence()
    fill(pool, a, list(range(9)))
    b = Sequence()
    matched = pool.match_prefix(b, list(range(9)) + [42])
    assert matched == 8
    assert b.block_table == a.block_table[:2]
    assert pool.stats().shared_blocks == 2
    # b's own tokens go to a new block; a's blocks are untouched.
    fill(pool, b, [42])
    assert b.block_table[2] != a.block_table[2]
    pool.release(a)
    pool.release(b)
    assert pool.stats().used_blocks == 0


def test_match_never_covers_the_last_token():
    pool = make_pool()
    a = Sequence()
    fill(pool, a, list(range(8)))
    b = Sequence()
    assert pool.match_prefix(b, list(range(8))) == 4  # the 8th token must be computed for logits


def test_hash_collision_cannot_serve_wrong_kv(monkeypatch):
    monkeypatch.setattr(bp, "block_hash", lambda parent, tokens, ns: bp.BlockHash(b"same" * 8))
    pool = make_pool()
    a = Sequence()
    fill(pool, a, [1, 2, 3, 4, 5])
    b = Sequence()
    assert pool.match_prefix(b, [9, 9, 9, 9, 9]) == 0  # same hash, different tokens: miss
    assert pool.match_prefix(Sequence(), [1, 2, 3, 4, 5]) == 4


def test_namespace_separates_models():
    pool_a = make_pool()
    h1 = bp.block_hash(None, [1, 2, 3, 4], b"model-a")
    h2 = bp.block_hash(None, [1, 2, 3, 4], b"model-b")
    assert h1 != h2
    assert bp.block_hash(h1, [5], b"model-a") != bp.block_hash(h2, [5], b"model-a")  # chained
    del pool_a


def test_copy_on_write_of_shared_partial_block():
    pool = make_pool()
    a = Sequence()
    fill(pool, a, [1, 2, 3, 4, 5, 6])
    b = pool.fork(a)
    assert b.block_table == a.block_table
    shared_tail = a.block_table[1]
    fill(pool, b, [7])  # writes into the shared partial block: must copy it first
    assert b.block_table[1] != shared_tail and a.block_table[1] == shared_tail
    flat = pool.kv.view(2, 2, -1, 2, 4)
    # The copy kept the shared tokens; the original did not see b's write.
    assert flat[0, 0, b.block_table[1] * 4 + 1, 0, 0].item() == 6.0
    assert flat[0, 0, b.block_table[1] * 4 + 2, 0, 0].item() == 7.0
    fill(pool, a, [8])
    assert flat[0, 0, a.block_table[1] * 4 + 2, 0, 0].item() == 8.0
    assert flat[0, 0, b.block_table[1] * 4 + 2, 0, 0].item() == 7.0
    pool.release(a)
    pool.release(b)
    assert pool.num_available == pool.num_blocks


def test_truncate_into_a_hashed_block_copies_before_writing():
    pool = make_pool()
    a = Sequence()
    fill(pool, a, [1, 2, 3, 4, 5])
    full_block = a.block_table[0]
    pool.truncate(a, 2)
    assert a.num_computed == 2 and a.block_table == [full_block] and a.block_hashes == []
    fill(pool, a, [9])
    assert a.block_table[0] != full_block  # the cached full block stays intact for others
    b = Sequence()
    assert pool.match_prefix(b, [1, 2, 3, 4, 5]) == 4
    pool.release(a)
    pool.release(b)


def test_out_of_blocks_is_all_or_nothing():
    pool = make_pool(num_blocks=3)
    a = Sequence()
    fill(pool, a, list(range(8)))
    before = (list(a.block_table), pool.num_available)
    a.token_ids.extend(range(100, 110))
    with pytest.raises(OutOfBlocksError, match="needs 3 more blocks"):
        pool.prepare_write(a, 10)
    assert (a.block_table, pool.num_available) == before
    pool.release(a)
    assert pool.num_available == 3


def test_cached_blocks_are_evicted_least_recently_released_first():
    pool = make_pool(num_blocks=4)
    a, b = Sequence(), Sequence()
    fill(pool, a, [1, 1, 1, 1])
    fill(pool, b, [2, 2, 2, 2])
    pool.release(a)
    pool.release(b)
    assert pool.stats().cached_blocks == 2 and pool.stats().free_blocks == 2
    c = Sequence()
    fill(pool, c, list(range(12)))  # needs 3 blocks: 2 free + evict a's (older)
    assert pool.stats().evicted_blocks == 1
    assert pool.match_prefix(Sequence(), [1, 1, 1, 1, 0]) == 0
    d = Sequence()
    assert pool.match_prefix(d, [2, 2, 2, 2, 0]) == 4
    pool.release(c)
    pool.release(d)
    assert pool.num_available == 4
