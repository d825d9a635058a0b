"""Random fork / append / prune / finish keep every invariant, end with no referenced block, and
copy-on-write never changes the KV a sibling sees (checked on the cache tensors)."""
from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import tiny_model
from jupyter_pagedkv import BeamSearchParams, Engine, SamplingParams
from jupyter_pagedkv.core.block_pool import BlockPool, NoFreeBlocksError
from jupyter_pagedkv.core.block_table import BlockTable
from jupyter_pagedkv.worker.kv_cache import KVCache, KVSpec

table_op = st.one_of(
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 9)),
    st.tuples(st.just("prune"), st.integers(0, 50)),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(table_op, min_size=1, max_size=60), block_size=st.sampled_from([1, 2, 4, 8]),
       num_blocks=st.integers(4, 40))
def test_fork_append_prune_keep_invariants_and_siblings_kv(ops, block_size, num_blocks):
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
    cache = KVCache(KVSpec(2, 1, 1, torch.float32), num_blocks, block_size)
    tables: list[BlockTable] = [BlockTable(pool)]
    shadows: list[list[float]] = [[]]     # the value each table must read at each of its positions
    written = 0

    def check() -> None:
        pool.check_invariants(Counter(b.block_id for t in tables for b in t.blocks))
        for t, shadow in zip(tables, shadows):
            assert t.num_slots == len(shadow) and len(t.blocks) == -(-len(shadow) // block_size)
            slots = torch.tensor([t.slot(p) for p in range(len(shadow))], dtype=torch.long)
            k = cache.k[:, slots // block_size, slots % block_size, 0, 0]
            v = cache.v[:, slots // block_size, slots % block_size, 0, 0]
            want = torch.tensor(shadow)
            assert torch.equal(k[0], want) and torch.equal(k[1], want * 2) and torch.equal(v[0], -want)

    for op in ops:
        if not tables:
            tables.append(BlockTable(pool))
            shadows.append([])
        i = op[1] % len(tables)
        if op[0] == "fork":
            tables.append(tables[i].fork())
            shadows.append(list(shadows[i]))
        elif op[0] == "append":
            table, shadow = tables[i], shadows[i]
            copies: list[tuple[int, int]] = []
            try:
                table.grow(len(shadow) + op[2], copies)
            except NoFreeBlocksError:
                check()
                continue
            cache.copy_blocks(copies)         # copy-on-write happens before the write, as in a step
            for p in range(len(shadow), len(shadow) + op[2]):
                written += 1
                b, o = divmod(table.slot(p), block_size)
                cache.k[0, b, o], cache.k[1, b, o], cache.v[:, b, o] = written, 2 * written, -written
                shadow.append(float(written))
        else:                                 # prune: the beam is dropped, its blocks return at once
            tables.pop(i).free()
            shadows.pop(i)
        check()
    while tables:                             # finish: every sequence ends
        tables.pop().free()
        shadows.pop()
        check()
    assert all(b.ref_count == 0 for b in pool.blocks) and pool.num_free == num_blocks


MODEL = tiny_model("llama", vocab=64, seed=5)

engine_op = st.one_of(
    st.tuples(st.just("beams"), st.integers(1, 20), st.integers(1, 10), st.integers(1, 4)),
    st.tuples(st.just("samples"), st.integers(1, 20), st.integers(1, 10), st.integers(1, 4)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(engine_op, min_size=1, max_size=20), block_size=st.sampled_from([2, 4]),
       num_blocks=st.integers(20, 48), budget=st.integers(3, 48), prefix_caching=st.booleans())
def test_beams_and_samples_on_the_engine_keep_invariants(ops, block_size, num_blocks, budget,
                                                         prefix_caching):
    engine = Engine(MODEL, None, block_size=block_size, num_blocks=num_blocks,
                    max_num_batched_tokens=budget, max_num_seqs=12,
                    enable_prefix_caching=prefix_caching)
    shared = list(range(3, 23))
    ids: list[str] = []
    for o in ops:
        if o[0] in ("beams", "samples"):
            _, plen, max_tokens, width = o
            params = (BeamSearchParams(beam_width=width, max_tokens=max_tokens) if o[0] == "beams" else
                      SamplingParams(n=width, max_tokens=max_tokens, temperature=1.0, seed=plen,
                                     ignore_eos=True))
            one = -(-(plen + max_tokens) // block_size)       # blocks of one sequence, unshared
            try:
                ids.append(engine.add_request(shared[:plen], params))
            except ValueError as err:
                # Refused up front only when its worst case exceeds the whole pool.
                assert "blocks" in str(err) and o[0] == "beams" and width * one > num_blocks, err
            else:
                assert o[0] == "samples" or one <= num_blocks
        elif o[0] == "step":
            for _ in range(o[1]):
                engine.step()
                engine.check_invariants()
        elif ids:
            engine.abort(ids[o[1] % len(ids)])
        engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert all(b.ref_count == 0 for b in engine._pool.blocks)
    assert len(engine._finished) == len(ids)          # every admitted request ended
    for req in engine._finished:
        if req.beam is not None and req.beam.done:
            assert len(req.beam.sequences) == req.beam.width
