"""Why a prompt missed the prefix cache: each cause is constructed on a real engine (tiny random
model) and `engine.why` must name it for exactly the blocks it applies to, report the hits as hits
(as many as the request's own num_cached_tokens) and name no cause that is false."""
from __future__ import annotations

import pytest

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.core.miss_report import (AFTER_MISS, CACHING_OFF, DIFFERS, EVICTED, HIT, LAST_TOKEN,
                                              OTHER_MODEL, OTHER_TENANT, PARTIAL, PROMPT_LOGPROBS)
from jupyter_pagedkv.notebook.magics import recomputed_line
from jupyter_pagedkv.testing.models import byte_tokenizer

MODEL = tiny_model("llama", seed=6)
TOK = byte_tokenizer()
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
PROMPT = list(range(40, 77))       # 37 tokens: 9 full blocks of 4 and a partial one


def run(engine, prompt, tenant=None, params=GREEDY):
    [out] = engine.generate([prompt], params, tenant=tenant)
    report = engine.why(out.request_id)
    assert report.num_hits * 4 == out.num_cached_tokens      # hits are reported as hits, all of them
    assert report.causes()[:report.num_hits] == [HIT] * report.num_hits
    assert len(report.causes()) == -(-len(prompt) // 4)
    return out, report


def spans(report):
    return [(s.first, s.last, s.cause) for s in report.spans]


def test_first_difference_partial_block_and_last_token_cap(make_engine):
    engine = make_engine(MODEL, TOK, block_size=4, num_blocks=64)
    _, first = run(engine, PROMPT)
    assert spans(first) == [(0, 0, DIFFERS), (1, 8, AFTER_MISS), (9, 9, PARTIAL)]
    assert first.spans[0].block_id is None and first.first_difference == 0    # nothing cached yet
    changed = PROMPT[:22] + [200] + PROMPT[23:]                                # token 22 differs
    out, report = run(engine, changed)
    assert spans(report) == [(0, 4, HIT), (5, 5, DIFFERS), (6, 8, AFTER_MISS), (9, 9, PARTIAL)]
    assert report.first_difference == 22 and report.spans[1].block_id is not None
    assert "▸" in report.snippet and "differs from the nearest cached chain at token 22" in str(report)
    assert report.num_reusable == 0 and recomputed_line(engine, out) is None
    # 36 tokens: block 8 is full and cached, but holds the last token, which is always computed.
    _, capped = run(engine, PROMPT[:36])
    assert spans(capped) == [(0, 7, HIT), (8, 8, LAST_TOKEN)]
    assert engine.why() == capped                                # no id: the newest request


def test_evicted_blocks_name_the_step_and_the_request(make_engine):
    engine = make_engine(MODEL, TOK, block_size=4, num_blocks=16)
    prompt = PROMPT[:26]                                         # 6 full blocks and a partial
    run(engine, prompt)
    step = engine.num_steps
    # 60 tokens take 15 of the 16 blocks in one step: the 10 never cached, then 5 of the prompt's
    # 6 cached blocks, least recently used first (the chain's tail: its head is freed last).
    one = SamplingParams(max_tokens=1, temperature=0.0)
    big, _ = run(engine, list(range(100, 160)), params=one)
    out, report = run(engine, prompt)
    assert spans(report) == [(0, 0, HIT), (1, 5, EVICTED), (6, 6, PARTIAL)]
    evicted = report.spans[1]
    assert (evicted.step, evicted.by) == (step, big.request_id)   # the step that admitted `big`
    assert f"blocks 1-5 were cached and evicted at step {step} for {big.request_id}" in str(report)
    assert report.num_reusable == 5 and "5 blocks recomputed" in recomputed_line(engine, out)
    last = engine.num_steps - 1
    engine.reset_prefix_cache()
    _, again = run(engine, prompt)
    assert spans(again) == [(0, 5, EVICTED), (6, 6, PARTIAL)]
    assert (again.spans[0].step, again.spans[0].by) == (last, "reset_prefix_cache()")


@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_another_tenants_salt(make_engine, scope):
    engine = make_engine(MODEL, TOK, block_size=4, num_blocks=64, prefix_cache_scope=scope)
    run(engine, PROMPT, tenant="alice")
    _, bob = run(engine, PROMPT, tenant="bob")
    _, nobody = run(engine, PROMPT[:30] + [9, 9, 9], tenant=None)
    if scope == "global":                                        # shared: hits, and no salt named
        assert spans(bob) == [(0, 8, HIT), (9, 9, PARTIAL)]
        assert spans(nobody) == [(0, 6, HIT), (7, 7, DIFFERS), (8, 8, PARTIAL)]
        return
    assert spans(bob) == [(0, 8, OTHER_TENANT), (9, 9, PARTIAL)]
    assert bob.spans[0].tenant == "alice" and "tenant 'alice''s salt" in str(bob)
    # Requests naming nobody are a tenant too; blocks 0-6 exist under alice's and bob's salts.
    assert spans(nobody) == [(0, 6, OTHER_TENANT), (7, 7, AFTER_MISS), (8, 8, PARTIAL)]
    assert nobody.spans[0].tenant in ("alice", "bob")


def test_prefix_caching_off_and_the_contiguous_baseline(make_engine):
    for options in ({"enable_prefix_caching": False}, {"allocator": "contiguous"}):
        engine = make_engine(MODEL, TOK, block_size=4, num_blocks=64, **options)
        run(engine, PROMPT)
        _, report = run(engine, PROMPT)
        assert spans(report) == [(0, 9, CACHING_OFF)] and "prefix caching is off" in str(report)


def test_prompt_logprobs_look_nothing_up(make_engine):
    engine = make_engine(MODEL, TOK, block_size=4, num_blocks=64)
    run(engine, PROMPT)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    _, report = run(engine, PROMPT, params=params)
    assert spans(report) == [(0, 8, PROMPT_LOGPROBS), (9, 9, PARTIAL)]


def test_another_model_or_revision(make_engine):
    old = make_engine(MODEL, TOK, block_size=4, num_blocks=64, name="tiny-a")
    run(old, PROMPT)
    ledger = old.prefix_ledger()
    assert ledger.identity == "tiny-a@main (float32)" and len(ledger.hashes) == 9
    new = make_engine(tiny_model("llama", seed=7), TOK, block_size=4, num_blocks=64, name="tiny-b")
    new.prefix_ledger(ledger)
    _, report = run(new, PROMPT)
    assert spans(report) == [(0, 8, OTHER_MODEL), (9, 9, PARTIAL)]
    assert report.spans[0].model == "tiny-a@main (float32)" and "cached by tiny-a@main (float32)" in str(report)
    # The same identity again (a reload) names no model: those blocks were never this pool's.
    same = make_engine(MODEL, TOK, block_size=4, num_blocks=64, name="tiny-a")
    same.prefix_ledger(ledger)
    _, fresh = run(same, PROMPT)
    assert spans(fresh) == [(0, 0, DIFFERS), (1, 8, AFTER_MISS), (9, 9, PARTIAL)]


def test_bad_request_ids_are_one_line(make_engine):
    engine = make_engine(MODEL, TOK, block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="no request yet"):
        engine.why()
    run(engine, PROMPT)
    with pytest.raises(ValueError, match="no request 'nope'"):
        engine.why("nope")
    rid = engine.add_request(PROMPT, GREEDY)
    with pytest.raises(ValueError, match="has not been admitted yet"):
        engine.why(rid)
    engine.abort(rid)


def test_the_monitor_feed_sends_each_requests_report_once(make_engine):
    """What the hover shows: a full frame carries every owner's report, a diff the new owners'."""
    from jupyter_pagedkv.monitor.feed import MonitorFeed

    engine = make_engine(MODEL, TOK, block_size=4, num_blocks=64)
    run(engine, PROMPT)
    feed = MonitorFeed(engine, threaded=False)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    diff = feed.publish()
    assert diff.why == {rid: str(engine.why(rid))} and "9 of 10 prompt blocks hit" in diff.why[rid]
    assert feed.full_frame().why == diff.why and feed.full_frame().header()["why"] == diff.why
    engine.step()
    assert feed.publish().why == {}                             # sent once, not with every diff
    engine.abort(rid)
    feed.close()


def test_loading_another_model_in_the_session_hands_the_old_chains_over(make_engine, monkeypatch):
    """`%pagedkv load` (KernelSession.load) gives the new engine the old one's prefix ledger."""
    from jupyter_pagedkv.engine.engine import Engine
    from jupyter_pagedkv.notebook import session as session_mod

    old = make_engine(MODEL, TOK, block_size=4, num_blocks=64, name="tiny-a")
    run(old, PROMPT)
    new = make_engine(tiny_model("llama", seed=7), TOK, block_size=4, num_blocks=64, name="tiny-b")
    monkeypatch.setattr(session_mod, "preflight", lambda *args, **kwargs: None)
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, model, **kwargs: new))
    kernel = session_mod.KernelSession(engine=old)
    kernel.load("tiny-b", progress=False)
    assert kernel.engine is new and old.model is None          # the old engine was unloaded first
    _, report = run(new, PROMPT)
    assert spans(report) == [(0, 8, OTHER_MODEL), (9, 9, PARTIAL)]


def test_the_eviction_log_is_bounded_and_forgets_the_oldest(monkeypatch):
    from jupyter_pagedkv.core import block_pool
    from jupyter_pagedkv.core.block_pool import BlockPool, hash_block

    monkeypatch.setattr(block_pool, "EVICTION_LOG_SIZE", 3)
    pool = BlockPool(1, 4)
    for i in range(5):                                  # one block, cached then evicted five times
        block = pool.allocate(None)
        pool.cache_block(block, hash_block(None, [i] * 4), None, [i] * 4)
        pool.free(block)
    pool.step, pool.claimant = 7, "req-9"
    pool.free(pool.allocate(None))
    assert list(pool.evictions) == [hash_block(None, [i] * 4) for i in (2, 3, 4)]
    assert pool.evictions[hash_block(None, [4] * 4)] == block_pool.Eviction(7, "req-9", 0)
