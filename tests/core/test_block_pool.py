"""BlockPool and BlockTable behave as docs/design.md specifies."""
from __future__ import annotations

from collections import Counter

import pytest

from jupyter_pagedkv.core.block_pool import BlockPool, NoFreeBlocksError, hash_block
from jupyter_pagedkv.core.block_table import BlockTable


def refs_of(*tables: BlockTable) -> Counter:
    return Counter(b.block_id for t in tables for b in t.blocks)


def test_allocation_takes_blocks_until_the_pool_is_dry():
    pool = BlockPool(4, 16)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(b.block_id for b in blocks) == [0, 1, 2, 3]
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_table_uses_ceil_len_over_block_size_blocks():
    pool = BlockPool(8, 4)
    table = BlockTable(pool)
    copies: list = []
    for n, want in [(1, 1), (4, 1), (5, 2), (13, 4)]:
        table.grow(n, copies)
        assert len(table.blocks) == want
    assert not copies
    assert table.slot(5) == table.blocks[1].block_id * 4 + 1
    pool.check_invariants(refs_of(table))


def test_grow_that_cannot_be_served_changes_nothing():
    pool = BlockPool(2, 4)
    table = BlockTable(pool)
    table.grow(8, [])
    with pytest.raises(NoFreeBlocksError):
        table.grow(9, [])
    assert table.num_slots == 8 and len(table.blocks) == 2
    pool.check_invariants(refs_of(table))


def test_extend_in_place_takes_only_room_in_an_owned_last_block():
    """The scheduler's decode fast path: slots in the blocks a table holds, never a new block or a
    write into a shared one (those go through `grow`, with the pool, caps and copy-on-write)."""
    pool = BlockPool(4, 4)
    table = BlockTable(pool)
    table.grow(5, [])                        # 2 blocks, 3 free slots in the second
    free = pool.num_free
    assert table.extend_in_place(8) and table.num_slots == 8 and pool.num_free == free
    assert table.extend_in_place(6) and table.num_slots == 8      # never shrinks
    assert not table.extend_in_place(9) and table.num_slots == 8 and len(table.blocks) == 2
    table.rollback(6)
    child = table.fork()                     # the half-full last block is now shared
    assert not child.extend_in_place(7) and not table.extend_in_place(7)
    assert child.num_slots == table.num_slots == 6 and pool.num_free == free
    pool.check_invariants(refs_of(table, child))


def test_fork_shares_every_block_and_copy_on_write_splits_the_last():
    pool = BlockPool(8, 4)
    parent = BlockTable(pool)
    parent.grow(6, [])                       # 2 blocks, the second half full
    child = parent.fork()
    assert [b.ref_count for b in parent.blocks] == [2, 2]
    copies: list = []
    child.grow(7, copies)                    # writing slot 6 lands in the shared block: copy it
    assert len(copies) == 1 and copies[0][0] == parent.blocks[1].block_id
    assert child.blocks[0] is parent.blocks[0] and child.blocks[1] is not parent.blocks[1]
    assert copies[0][1] == child.blocks[1].block_id
    assert [b.ref_count for b in parent.blocks] == [2, 1]
    pool.check_invariants(refs_of(parent, child))
    # A full shared block is never written, so growing past it needs no copy.
    parent.grow(8, [])
    full = parent.fork()
    copies = []
    full.grow(9, copies)
    assert copies == []
    pool.check_invariants(refs_of(parent, child, full))


def test_rollback_frees_blocks_left_empty():
    pool = BlockPool(8, 4)
    table = BlockTable(pool)
    table.grow(10, [])
    assert pool.num_free == 5
    table.rollback(5)
    assert len(table.blocks) == 2 and table.num_slots == 5 and pool.num_free == 6
    table.rollback(0)
    assert table.blocks == [] and pool.num_free == 8
    pool.check_invariants(Counter())


def publish(pool: BlockPool, table: BlockTable, tokens: list[int]) -> list[int]:
    bs = pool.block_size
    hashes, parent = [], None
    for i, block in enumerate(table.blocks[: len(tokens) // bs]):
        chunk = tokens[i * bs:(i + 1) * bs]
        h = hash_block(parent, chunk)
        pool.cache_block(block, h, parent, chunk)
        hashes.append(h)
        parent = h
    return hashes


def test_freed_hashed_block_stays_cached_and_hits_leave_the_free_queue():
    pool = BlockPool(4, 2)
    table = BlockTable(pool)
    table.grow(4, [])
    tokens = [5, 6, 7, 8]
    h = publish(pool, table, tokens)
    ids = table.block_ids
    table.free()
    assert pool.num_free == 4 and len(pool.cached) == 2
    hit = pool.lookup(h[0], None, tokens[:2])
    assert hit is not None and hit.block_id == ids[0]
    pool.incref(hit)                         # O(1) unlink from the middle of the queue
    assert pool.num_free == 3 and hit.ref_count == 1
    pool.free(hit)
    pool.check_invariants(Counter())


def test_lookup_rejects_a_colliding_hash_with_other_content():
    pool = BlockPool(2, 2)
    table = BlockTable(pool)
    table.grow(2, [])
    h = publish(pool, table, [1, 2])[0]
    assert pool.lookup(h, None, [1, 3]) is None
    assert pool.lookup(h, 123, [1, 2]) is None


def test_eviction_order_is_lru_and_unhashed_blocks_go_first():
    pool = BlockPool(4, 2)
    a, b = BlockTable(pool), BlockTable(pool)
    a.grow(2, [])
    b.grow(2, [])
    publish(pool, a, [1, 2])
    publish(pool, b, [3, 4])
    a_block, b_block = a.blocks[0], b.blocks[0]
    a.free()                                  # a is older in the LRU than b
    b.free()
    # Two never-used blocks are handed out before any cached one.
    first, second = pool.allocate(), pool.allocate()
    assert {first.block_id, second.block_id}.isdisjoint({a_block.block_id, b_block.block_id})
    third = pool.allocate()
    assert third is a_block and third.block_hash is None and pool.num_evictions == 1
    assert len(pool.cached) == 1


def test_sequence_blocks_are_evicted_tail_first():
    pool = BlockPool(3, 2)
    t = BlockTable(pool)
    t.grow(6, [])
    publish(pool, t, [1, 2, 3, 4, 5, 6])
    blocks = list(t.blocks)
    t.free()
    assert pool.allocate() is blocks[2]       # the deepest prefix block goes first
    assert pool.allocate() is blocks[1]


def test_reset_cache_forgets_prefixes():
    pool = BlockPool(2, 2)
    t = BlockTable(pool)
    t.grow(2, [])
    publish(pool, t, [1, 2])
    t.free()
    assert pool.reset_cache() == 1
    assert not pool.cached
    pool.check_invariants(Counter())


def test_invariant_checker_catches_a_wrong_ref_count():
    pool = BlockPool(2, 2)
    t = BlockTable(pool)
    t.grow(2, [])
    t.blocks[0].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        pool.check_invariants(refs_of(t))


def test_the_id_array_follows_every_change_of_a_table():
    """`ids()` is what a step stages a row from: after growth past its capacity, copy-on-write,
    rollback, fork, adoption and freeing it equals the blocks' ids, read before and after."""
    pool = BlockPool(64, 2)
    table = BlockTable(pool)
    copies: list = []
    same = lambda t: t.ids().tolist() == [b.block_id for b in t.blocks]  # noqa: E731
    for n in (1, 3, 8, 33, 40, 41):        # 41 slots: 21 blocks, past the first array's 16
        table.grow(n, copies)
        assert same(table)
    child = table.fork()
    assert same(child) and child.ids().tolist() == table.ids().tolist()
    child.grow(42, copies)                 # the shared, half-full last block is copied
    assert copies and same(child) and child.ids()[-1] != table.ids()[-1] and same(table)
    child.rollback(20)
    assert same(child) and len(child.ids()) == 10
    child.grow(30, copies)                 # regrows into the array it kept
    assert same(child)
    other = BlockTable(pool)
    other.adopt(table.blocks[:3])
    assert same(other)
    other.free()
    other.blocks = pool.allocate_many(2, None)   # as a swap-in assigns a table's blocks
    assert same(other)
    pool.free_all(other.blocks, None)
    other.blocks = []
    for t in (table, child):
        t.free()
        assert same(t) and len(t.ids()) == 0
    pool.check_invariants(Counter(), {})
