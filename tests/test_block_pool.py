"""The block pool on the CPU: allocation, sharing, copy on write, eviction, no leaks."""

from __future__ import annotations

import random

import pytest
import torch

from chatkv import block_pool as bp
from chatkv.block_pool import BlockPool, slot_runs
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


def test_prefix_plan_foresees_match_prefix_and_the_counters_count_blocks_and_misses():
    pool = make_pool(num_blocks=12)
    a = Sequence()
    fill(pool, a, list(range(13)))  # three full blocks hashed
    pool.release_tail_first(a)  # ...now cached, held by no one
    cases = [
        (list(range(13)) + [99], 12, 0),  # all three, then nothing left to look up: no miss
        (list(range(8)) + [7, 7, 7, 7, 5], 8, 1),  # two, then a block no one holds
        ([5] * 9, 0, 1),  # none
        (list(range(4)), 0, 0),  # no full block before the last token: nothing looked up
    ]
    for ids, tokens, misses in cases:
        planned, revived = pool.prefix_plan(ids)
        hits, missed = pool.prefix_hits, pool.prefix_misses
        seq = Sequence()
        assert (planned, pool.match_prefix(seq, ids)) == (tokens, tokens)
        assert revived == tokens // 4  # each block cached, not held: planning counted it as revived
        assert (pool.prefix_hits - hits, pool.prefix_misses - missed) == (tokens // 4, misses)
        assert seq.token_ids == ids[:tokens] and seq.num_computed == tokens
        pool.release_tail_first(seq)


def test_hash_collision_cannot_serve_wrong_kv(monkeypatch):
    monkeypatch.setattr(bp, "_block_digest", lambda parent, ns, packed: bp.BlockHash(b"same" * 8))  # every hash
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


def test_free_blocks_are_handed_out_lowest_first_so_the_pool_stays_compact():
    """A CPU pool commits its pages on first write: reusing the lowest free
    blocks keeps the working set (and resident memory) at the pool's start."""
    pool = make_pool(num_blocks=16)
    a, b, c = Sequence(), Sequence(), Sequence()
    fill(pool, a, list(range(8)))        # blocks 0, 1
    fill(pool, b, list(range(100, 108)))  # blocks 2, 3
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    pool.release(a)
    pool.evict_cached()
    fill(pool, c, list(range(200, 212)))  # a's blocks first, then the next free one
    assert c.block_table[:2] == [0, 1] and c.block_table[2] == 4
    pool.release(b)
    pool.release(c)
    assert pool.stats().used_blocks == 0


def test_free_block_bookkeeping_survives_any_order_of_operations():
    import random

    rng = random.Random(0)
    free = bp.FreeBlocks(50)
    ref = set(range(50))
    for _ in range(5000):
        op = rng.random()
        if op < 0.4 and ref:
            got = free.take_lowest()
            assert got == min(ref)
            ref.remove(got)
        elif op < 0.7 and ref:
            block = rng.choice(sorted(ref))
            assert block in free
            free.take(block)
            ref.remove(block)
        elif len(ref) < 50:
            block = rng.choice(sorted(set(range(50)) - ref))
            free.add(block)
            ref.add(block)
        assert len(free) == len(ref)
    assert len(free._heap) <= 2 * len(ref) + 65  # stale entries are dropped, never pile up


def test_reserved_slots_are_filled_then_committed_or_given_back():
    pool = make_pool()
    seq = Sequence()
    fill(pool, seq, [1, 2, 3, 4, 5])
    slots = pool.reserve(seq, [6, 7, 8, 9, 10, 11])
    assert seq.num_computed == 5 and seq.token_ids[-1] == 11 and len(slots) == 6
    kv = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1, 1).expand(2, 2, 6, 2, 4).contiguous()
    pool.fill(slots[:3], kv[:, :, :3])
    # the same bytes through the pool's bytes where a file reader puts them
    planes = pool.slot_planes(seq, 8, 3)  # slots[3:]
    assert planes is not None
    memory, starts, runs = planes
    assert len(starts) == 2 * 2
    for start, row in zip(starts, kv[:, :, 3:].reshape(4, -1)):
        data = row.numpy().tobytes()
        assert sum(b - a for a, b in runs) == len(data)
        at = 0
        for a, b in runs:  # several when the slots are not consecutive
            memory[start + a: start + b] = data[at: at + b - a]
            at += b - a
    pool.commit(seq, 4)  # tokens 6..9 verified; 10 and 11 were not
    pool.truncate(seq, seq.num_computed)
    assert seq.num_computed == 9 and seq.token_ids == list(range(1, 10))
    got = pool.read_tokens(seq, 5, 4)
    assert torch.equal(got, kv[:, :, :4])
    pool.release(seq)
    assert pool.stats().used_blocks == 0


def test_reserved_slots_follow_scattered_blocks_from_a_partial_one():
    """The slots of many tokens (more than a block) are each token's block's
    slot, from a partly filled block on and across blocks that are not
    neighbours in the pool, as a token at a time gives them."""
    pool = make_pool(num_blocks=16, block_size=4)
    a, b = Sequence(), Sequence()
    fill(pool, a, [1, 2, 3])
    fill(pool, b, [9])
    for step in range(3):  # blocks taken in turn by a and b: a's are not neighbours
        pool.reserve(b, [10 + step] * 4)
        pool.commit(b, 4)
        pool.reserve(a, list(range(4 + 4 * step, 8 + 4 * step)))
        pool.commit(a, 4)
    assert any(y != x + 1 for x, y in zip(a.block_table, a.block_table[1:]))
    start = a.num_computed
    slots = pool.reserve(a, list(range(100, 111)))  # from the middle of a block over three more
    bs = pool.block_size
    assert slots == [a.block_table[p // bs] * bs + p % bs for p in range(start, start + 11)]
    assert len(set(slots)) == 11
    row = 2 * 4 * 4  # kv_heads * head_dim * float32
    for first in range(a.num_computed + 11):  # the planes' runs, found a block at a time
        for count in range(a.num_computed + 11 - first + 1):
            want = [(s * row, (s + n) * row) for _, s, n in slot_runs(pool._slots(a, first, count))]
            assert pool.slot_planes(a, first, count)[2] == want, (first, count)
    pool.release(a)
    pool.release(b)


def test_runs_of_free_blocks_are_taken_as_one_at_a_time_would_take_them():
    """A long write takes the free blocks after its last one as a run, then,
    where the run breaks, the next free or the lowest free block: the same
    blocks, in the same order, as taking them one by one."""
    rng = random.Random(3)
    for case in range(200):
        pool, ref = make_pool(num_blocks=40), make_pool(num_blocks=40)
        taken = rng.sample(range(40), rng.randrange(0, 20))
        holders = []
        for p in (pool, ref):  # the same scattered blocks held in both
            h = Sequence()
            for block in taken:
                p._free.take(block)
                p.ref_counts[block] = 1
                h.block_table.append(block)
            holders.append(h)
        seq, seq_ref = Sequence(), Sequence()
        n = rng.randrange(1, 4 * (40 - len(taken)) + 1)
        seq.token_ids = list(range(n))
        slots = pool.prepare_write(seq, n)
        bs = ref.block_size
        while len(seq_ref.block_table) * bs < n:  # the block-by-block reference
            seq_ref.block_table.append(ref._allocate(seq_ref.block_table[-1] if seq_ref.block_table else None))
        assert seq.block_table == seq_ref.block_table, case
        assert slots == [seq.block_table[t // bs] * bs + t % bs for t in range(n)]
        assert all(pool.ref_counts[b] == 1 for b in seq.block_table) and len(pool._free) == len(ref._free)
        seq.token_ids = []
        for b in seq.block_table:
            pool._decref(b)
        assert len(pool._free) == 40 - len(taken)


@pytest.mark.parametrize("shift_at", [None, 0, 6])
def test_hashes_computed_ahead_are_the_ones_commit_computes(shift_at):
    """A restore hashes its blocks while it reads them (chain_hashes, off the
    loop) and hands them to commit: the same hashes, published the same way,
    as commit computes itself, shifted namespaces included."""
    from chatkv.sequence import Shift

    shift = None if shift_at is None else Shift(sink=shift_at * 4, dropped=5, key=b"dropped")
    tokens = list(range(500, 530))
    own, given = make_pool(num_blocks=16), make_pool(num_blocks=16)
    a, b = Sequence(), Sequence()
    a.shift = b.shift = shift
    for pool, seq in ((own, a), (given, b)):
        fill(pool, seq, tokens[:8])
    ahead = given.chain_hashes(b.block_hashes[-1], tokens[8:], 2, shift)
    assert sorted(ahead) == list(range(2, 7))  # full blocks only
    own.reserve(a, tokens[8:])
    given.reserve(b, tokens[8:])
    own.commit(a, 13)
    given.commit(b, 13, ahead)
    assert a.block_hashes == b.block_hashes and len(b.block_hashes) == 5
    own.commit(a, 9)
    given.commit(b, 9, ahead)
    assert a.block_hashes == b.block_hashes and len(b.block_hashes) == 7
    assert b.block_hashes[2:] == list(ahead.values())
    assert set(own.hash_to_block) == set(given.hash_to_block)
    wrong = dict(ahead)
    wrong[3] = ahead[4]
    c = Sequence()
    c.shift = shift
    fill(given, c, tokens[:8])
    given.reserve(c, tokens[8:])
    with pytest.raises(AssertionError, match="wrong hash"):  # the tests' checking mode compares
        given.commit(c, 16, wrong)


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("held", [[], [0, 1], [0, 1, 2, 3, 4, 5], [2, 3]])
def test_commit_takes_the_hashes_ahead_holds_and_computes_the_rest(monkeypatch, check: bool, held: list[int]):
    """Whichever blocks ``ahead`` holds (none, a first few, all, or ones after
    a gap), commit's hashes are those of a commit without it, in the loop's
    own mode (``CHECK_OWNER`` off, where those ahead are taken unchecked) and
    in the tests' mode."""
    monkeypatch.setattr(bp, "CHECK_OWNER", check)
    tokens = list(range(700, 726))  # six full blocks of 4 and 2 tokens
    own, given = make_pool(num_blocks=16), make_pool(num_blocks=16)
    a, b = Sequence(), Sequence()
    fill(own, a, tokens)
    every = given.chain_hashes(None, tokens, 0)
    given.reserve(b, tokens)
    given.commit(b, 10, {i: every[i] for i in held})  # blocks 0 and 1
    given.commit(b, 16, {i: every[i] for i in held})  # blocks 2 to 5
    assert b.block_hashes == a.block_hashes == list(every.values())
    assert set(given.hash_to_block) == set(own.hash_to_block)


def test_commit_pages_writes_only_free_blocks():
    pool = make_pool(num_blocks=8)
    seq = Sequence()
    fill(pool, seq, list(range(1, 7)))  # blocks 0, 1
    before = pool.read_tokens(seq, 0, 6)
    per_block = pool.bytes_per_block
    assert pool.commit_pages(3 * per_block) == 1  # blocks 0 and 1 are in use: block 2 only
    assert pool.commit_pages(100 * per_block) == 6
    assert torch.equal(pool.read_tokens(seq, 0, 6), before)


@pytest.mark.parametrize("n", [0, 1, 2, 64, 65, 256, 257, 300])
def test_slot_runs_cuts_slots_into_consecutive_runs(n):
    rng = random.Random(n)
    slots, at = [], 0
    while len(slots) < n:  # runs of random lengths at random places, some touching
        at += rng.choice([1, 2, 17])
        length = rng.randint(1, 40)
        slots.extend(range(at, at + length))
        at += length - 1
    slots = slots[:n]
    runs = slot_runs(slots)
    assert [s for _, first, length in runs for s in range(first, first + length)] == slots
    assert [i for i, _, _ in runs] == [sum(r[2] for r in runs[:k]) for k in range(len(runs))]
    assert all(slots[i + length - 1] + 1 != (slots[i + length] if i + length < n else None)
               for i, _, length in runs)  # each run as long as it goes


@pytest.mark.parametrize("start,count", [(0, 23), (3, 9), (8, 1), (5, 18)])
def test_read_tokens_copies_each_tokens_kv_from_wherever_its_block_is(start, count):
    pool = make_pool(num_blocks=16)
    pool.kv.copy_(torch.arange(pool.kv.numel(), dtype=torch.float32).view_as(pool.kv))
    seq = Sequence(token_ids=list(range(23)), block_table=[9, 2, 3, 12, 13, 14], num_computed=23)  # runs 9 | 2-3 | 12-14
    got = pool.read_tokens(seq, start, count)
    flat = pool.kv.view(2, 2, -1, 2, 4)
    want = torch.stack([flat[:, :, seq.block_table[p // 4] * 4 + p % 4] for p in range(start, start + count)], 2)
    assert got.shape == (2, 2, count, 2, 4) and torch.equal(got, want) and got.is_contiguous()
