"""`EngineClient.block_tables()`: every live sequence's block table, copied in one look under the
engine's lock, agreeing with the pool's own snapshot (owners and ref counts) at the same instant."""
from __future__ import annotations

import dataclasses
from collections import Counter

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams

MODEL = tiny_model("llama", seed=4)


def test_block_tables_describe_every_live_sequence_as_the_pool_does(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, enable_prefix_caching=False)
    one = engine.add_request(list(range(3, 13)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    two = engine.add_request(list(range(20, 27)), SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=1,
                                                                 ignore_eos=True), tenant="alice")
    for _ in range(3):
        engine.step()
    tables, snap = engine.block_tables(), engine.pool_snapshot()
    assert [(t.request_id, t.sample_index, t.num_samples) for t in tables] == [(one, 0, 1), (two, 0, 2), (two, 1, 2)]
    assert {t.tenant for t in tables} == {None, "alice"} and {t.state for t in tables} == {"running"}
    for t in tables:
        assert t.num_slots == t.num_tokens - 1              # the last sampled token's KV is written next step
        assert len(t.block_ids) == -(-t.num_slots // 4)
        assert all(t.request_id in snap["owners"][b] for b in t.block_ids)
    holders = Counter(b for t in tables for b in t.block_ids)
    assert [holders[b] for b in range(snap["num_blocks"])] == list(snap["ref_counts"])


def test_a_view_is_a_copy_that_later_steps_leave_alone(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    engine.add_request(list(range(3, 9)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.step()
    before = engine.block_tables()
    kept = [dataclasses.replace(t) for t in before]
    for _ in range(6):
        engine.step()
    after = engine.block_tables()
    assert before == kept and after[0].num_tokens == before[0].num_tokens + 6
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_tables() == []
