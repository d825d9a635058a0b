"""Tenants on requests and prefix isolation: under prefix_cache_scope="tenant" a block's hash chain
is salted with its tenant, so no tenant hits another's cached prefix, while sharing inside a tenant
(its own prefixes, n samples, beams) is unchanged; outputs stay exact; bad names are one line."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import BeamSearchParams, SamplingParams

MODEL = tiny_model("llama", seed=6)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 40))            # 37 tokens: 9 full blocks of 4 (the last token never hits)


def run_one(engine, prompt, tenant):
    [out] = engine.generate([prompt], GREEDY, tenant=tenant)
    engine.check_invariants()
    return out


@pytest.mark.parametrize("scope, b_hits", [("tenant", 0), ("global", 36)])
def test_the_same_prompt_from_two_tenants(make_engine, scope, b_hits):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, prefix_cache_scope=scope)
    a1 = run_one(engine, PROMPT, "alice")
    b = run_one(engine, PROMPT, "bob")
    a2 = run_one(engine, PROMPT, "alice")
    assert (a1.num_cached_tokens, b.num_cached_tokens, a2.num_cached_tokens) == (0, b_hits, 36)
    assert (a1.tenant, b.tenant, a2.tenant) == ("alice", "bob", "alice")
    assert a1.token_ids == b.token_ids == a2.token_ids          # isolation changes no output


def test_unnamed_requests_share_among_themselves_only(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, prefix_cache_scope="tenant")
    assert run_one(engine, PROMPT, None).num_cached_tokens == 0
    assert run_one(engine, PROMPT, None).num_cached_tokens == 36
    assert run_one(engine, PROMPT, "alice").num_cached_tokens == 0


def test_sharing_inside_a_tenant_is_unchanged(make_engine):
    """n samples fork the prompt's blocks and beams share their history, salted or not."""
    for scope in ("global", "tenant"):
        engine = make_engine(MODEL, block_size=4, num_blocks=96, prefix_cache_scope=scope)
        shared = []
        engine.add_step_listener(lambda: shared.append(engine.stats().num_shared))
        [out] = engine.generate([PROMPT], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=2),
                                tenant="alice")
        assert len(out.outputs) == 3 and max(shared) >= 9
        [beams] = engine.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=5), tenant="alice")
        assert len(beams.sequences) == 3
        engine.check_invariants()


tenants = st.sampled_from([None, "a", "b", "c"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.tuples(tenants, st.integers(0, 2), st.integers(0, 12)), min_size=1,
                                 max_size=4), min_size=1, max_size=4))
def test_no_prefix_ever_crosses_tenants(make_engine, batches):
    """Random tenants send prompts built from three shared stems: after every step each cached
    block a sequence holds carries its tenant's salt (invariant 7), and a request's cache hit never
    exceeds what its own tenant had computed before it (an independent count from the prompts)."""
    stems = [list(range(5, 33)), list(range(5, 21)) + list(range(60, 72)), list(range(80, 108))]
    engine = make_engine(MODEL, block_size=4, num_blocks=48, prefix_cache_scope="tenant")
    engine.add_step_listener(engine.check_invariants)
    seen: dict[object, list[list[int]]] = {}
    for batch in batches:
        prompts = [stems[s] + list(range(120, 120 + extra)) for _, s, extra in batch]
        outs = [engine.generate([p], GREEDY, tenant=t)[0] for (t, _, _), p in zip(batch, prompts)]
        for (t, _, _), p, o in zip(batch, prompts, outs):
            own = seen.setdefault(t, [])
            longest = max((next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                           for q in own), default=0)
            assert o.num_cached_tokens <= min(longest, len(p) - 1) // 4 * 4, (t, o.num_cached_tokens, longest)
            own.append(p + o.token_ids)
    engine.check_invariants()
    assert engine.stats().num_used == 0


def test_greedy_output_is_exact_whatever_the_tenants(make_engine):
    rng = random.Random(3)
    stem = [rng.randrange(3, 250) for _ in range(24)]
    prompts = [stem + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    refs = [hf_greedy(MODEL, p, 8, stop_at_eos=False) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for scope in ("global", "tenant"):
        engine = make_engine(MODEL, block_size=4, num_blocks=80, prefix_cache_scope=scope)
        ids = [engine.add_request(p, params, tenant=["a", "b", None][i % 3]) for i, p in enumerate(prompts)]
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
        for p, rid, ref in zip(prompts, ids, refs):
            assert_same_or_near_tie(MODEL, p, outs[rid].token_ids, ref)
        engine.check_invariants()


@pytest.mark.parametrize("bad", ["", "   ", 7, ["alice"]])
def test_a_bad_tenant_name_is_one_line_and_leaks_nothing(make_engine, bad):
    engine = make_engine(MODEL, block_size=4, num_blocks=16, prefix_cache_scope="tenant")
    with pytest.raises(ValueError, match=r"tenant must be a non-empty string such as 'alice'") as err:
        engine.generate([PROMPT[:5], PROMPT[:9]], GREEDY, tenant=bad)
    assert "\n" not in str(err.value)
    assert not engine.has_unfinished_requests() and engine.stats().num_used == 0


def test_a_bad_scope_is_one_line(make_engine):
    with pytest.raises(ValueError, match=r"prefix_cache_scope must be 'global' or 'tenant', got 'user'"):
        make_engine(MODEL, block_size=4, num_blocks=16, prefix_cache_scope="user")

