"""The contiguous baseline: one run per request, first fit, and the waste paging removes."""
from __future__ import annotations

import pytest

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.core.block_pool import BlockPool
from jupyter_pagedkv.core.block_table import BlockTable
from jupyter_pagedkv.core.contiguous import ContiguousArena

MODEL = tiny_model("llama", seed=8)


def arena(num_blocks: int = 16, block_size: int = 4) -> ContiguousArena:
    return ContiguousArena(BlockPool(num_blocks, block_size, enable_prefix_caching=False))


def reserve(a: ContiguousArena, tokens: int) -> BlockTable | None:
    table = BlockTable(a.pool)
    return table if a.reserve(table, tokens) else None


def test_first_fit_places_each_run_in_the_lowest_gap_that_holds_it():
    a = arena()
    t1, t2, t3 = reserve(a, 8), reserve(a, 12), reserve(a, 8)    # blocks 0-1, 2-4, 5-6
    assert [t.block_ids for t in (t1, t2, t3)] == [[0, 1], [2, 3, 4], [5, 6]]
    a.release(t2)                                                 # gap 2-4 and tail 7-15
    assert reserve(a, 8).block_ids == [2, 3]                      # first fit, not best fit
    a.check_invariants()


def test_external_fragmentation_refuses_a_request_that_total_free_space_would_hold():
    a = arena(num_blocks=8)
    tables = [reserve(a, 8) for _ in range(4)]                    # 4 runs of 2 blocks: full
    a.release(tables[0])
    a.release(tables[2])                                          # free: 0-1 and 4-5
    assert a.pool.num_free == 4
    assert reserve(a, 16) is None                                 # needs 4 adjacent blocks
    assert a.num_refused_external == 1
    frag = a.fragmentation()
    assert (frag.num_free, frag.largest_extent, frag.num_extents) == (4, 2, 2)
    a.release(tables[1])                                          # 0-5 merge into one run
    assert a.fragmentation().largest_extent == 6 and reserve(a, 16).block_ids == [0, 1, 2, 3]
    a.check_invariants()


def test_releasing_every_run_merges_the_arena_back_into_one_extent():
    a = arena()
    tables = [reserve(a, 4 * k) for k in (1, 3, 2, 4, 1)]
    for i in (3, 0, 4, 1, 2):
        a.release(tables[i])
    assert a.fragmentation().num_extents == 1 and a.pool.num_free == 16
    a.check_invariants()


def test_the_arena_refuses_a_pool_that_caches_prefixes():
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        ContiguousArena(BlockPool(8, 4, enable_prefix_caching=True))


def test_reservation_and_internal_waste_are_real_in_the_engine(make_engine):
    """A request reserves prompt + max_tokens at admission; stopping early leaves slots unused."""
    engine = make_engine(MODEL, block_size=4, num_blocks=64, allocator="contiguous")
    prompt = list(range(1, 11))
    engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                              stop_token_ids=[]))
    engine.step()                                                 # prefill + first token
    stats = engine.stats()
    assert stats.slots_allocated == 52                            # ceil(50 / 4) blocks, held from the start
    assert stats.tokens_stored == 10
    assert stats.internal_waste == 42                             # reservation waste, for real
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_used == 0


def test_contiguous_refuses_admission_that_paging_grants(make_engine):
    """Same requests, same pool: paging runs them all at once, the baseline queues them."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(12)] for i in range(6)]
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    concurrent = {}
    outputs = {}
    for allocator in ("paged", "contiguous"):
        engine = make_engine(MODEL, block_size=4, num_blocks=48, allocator=allocator,
                             enable_prefix_caching=False)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()
        concurrent[allocator] = len(engine._scheduler.running)
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
        outputs[allocator] = [outs[k] for k in sorted(outs)]
        engine.check_invariants()
    # 12 + 36 = 48 slots = 12 blocks reserved each: 4 fit in 48 blocks; paging needs 3-4 blocks now.
    assert concurrent == {"paged": 6, "contiguous": 4}
    assert outputs["paged"] == outputs["contiguous"]              # only memory management differs


def test_contiguous_refuses_parallel_samples(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, allocator="contiguous")
    with pytest.raises(ValueError, match="allocator=.paged."):
        engine.add_request([1, 2, 3], SamplingParams(n=2))


def test_unknown_allocator_is_one_clear_error():
    from jupyter_pagedkv import Engine
    with pytest.raises(ValueError, match="'paged' or 'contiguous'"):
        Engine(MODEL, allocator="buddy")
