"""Preemptive priority (scheduling_policy="priority") in the scheduler alone, no model.

Invariant 11 (docs/design.md), checked after every `schedule()`: let W be the first of the waiting
and swapped requests in queue order (lowest priority value, then arrival) and L the running
requests of strictly lower priority (higher value). If L is not empty, W does not fit even with
all of L preempted: the token budget left at W's turn is 0 (and then nothing of L got a chunk),
or no sequence slot would be free, or the blocks W's first chunk takes exceed the free blocks,
minus the watermark (when anything would still run), plus the blocks only L references.

A tenant waits as a whole for the rest of a step, as the scheduler has it, when its first
queued request is over its cap (max_blocks, invariant 8) or one of its requests was preempted in
this step (not back before the next): W is the first request of another tenant then. The driver
stands in for the engine (as tests/core/test_fair_share.py's): every scheduled chunk is
computed, every sampling chunk appends token 1, a request finishes at its own length."""
from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from jupyter_pagedkv.core.block_pool import BlockPool
from jupyter_pagedkv.core.block_table import BlockTable
from jupyter_pagedkv.core.invariants import check_invariants
from jupyter_pagedkv.core.kv_cache_manager import PagedKVCacheManager
from jupyter_pagedkv.core.sampling_params import SamplingParams
from jupyter_pagedkv.core.scheduler import SampledTokens, Scheduler
from jupyter_pagedkv.core.sequence import Sequence, SequenceStatus
from jupyter_pagedkv.core.swap_space import SwapSpace
from jupyter_pagedkv.core.tenancy import queue_order


def freeable(seqs) -> int:
    """Blocks referenced by `seqs` and nobody else (counted here from the tables, not by the kv manager)."""
    refs = Counter(b.block_id for s in seqs for b in s.block_table.blocks)
    by_id = {b.block_id: b for s in seqs for b in s.block_table.blocks}
    return sum(1 for bid, n in refs.items() if by_id[bid].ref_count == n)


def violation(sched: Scheduler, out) -> str | None:
    """Invariant 11 after `out = sched.schedule()`, before the step's tokens: None when it holds."""
    kv = sched.kv

    def budget_at(w):
        return sched.max_num_batched_tokens - sum(c.num_tokens for c in out.chunks
                                                  if queue_order(c.seq) < queue_order(w))

    def tenant_blocks(w):   # what W would add to its tenant's count (its cap's measure)
        if w.status is SequenceStatus.SWAPPED:
            return kv.blocks_to_swap_in(w, w.num_computed_tokens + 1)
        return kv.computed_blocks(w, max(1, budget_at(w))).num_tenant_blocks

    # A tenant whose first queued request its cap keeps out waits whatever runs (invariant 8, as
    # the scheduler blocks it for the step): W is the first request of another tenant then.
    queued, seen, blocked = [], set(), {s.tenant for s in out.preempted}
    for s in sorted([*sched.waiting, *sched.swapped], key=queue_order):
        if s.tenant not in seen and sched.tenancy.over_cap(s.tenant, tenant_blocks(s)):
            blocked.add(s.tenant)
        seen.add(s.tenant)
        if s.tenant not in blocked:
            queued.append(s)
    if not queued:
        return None
    w = queued[0]
    lower = [s for s in sched.running if s.priority > w.priority]
    if not lower:
        return None
    budget = budget_at(w)
    if budget <= 0:
        served = [c.seq.request_id for c in out.chunks if c.seq.priority > w.priority]
        return f"{served} of lower priority than {w.request_id} ran on its budget" if served else None
    if len(sched.running) - len(lower) >= sched.max_num_seqs:
        return None
    if w.status is SequenceStatus.SWAPPED:
        n = min(w.num_tokens - w.num_computed_tokens, budget)
        need = kv.blocks_to_swap_in(w, w.num_computed_tokens + n)
    else:
        need = kv.computed_blocks(w, budget).num_new_blocks
    reserve = sched.watermark_blocks if len(sched.running) > len(lower) else 0
    room = kv.num_free - reserve + freeable(lower)
    if need > room:
        return None
    return (f"{w.request_id} (priority {w.priority}, needs {need} of {room} blocks) waits while "
            f"{[s.request_id for s in lower]} of lower priority run")


def step(sched: Scheduler, finished: list) -> object:
    out = sched.schedule()

    def append(seq, token):
        seq.token_ids.append(token)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
            finished.append(seq)

    problem = violation(sched, out)
    sched.update_from_output(out, lambda: [SampledTokens(c.seq, [1]) for c in out.chunks if c.samples], append)
    assert problem is None, problem
    return out


def make(num_blocks, block_size, max_num_seqs, budget, prefix_caching, swap_slots, policy="priority"):
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    swap = SwapSpace(swap_slots) if swap_slots else None
    return pool, Scheduler(PagedKVCacheManager(pool, swap), max_num_seqs, budget, policy=policy)


def request(pool, rid, prompt, max_tokens, arrival, priority, tenant=None):
    return Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens),
                    BlockTable(pool), arrival, priority, tenant=tenant)


arrivals = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(1, 24),
                              st.integers(1, 16), st.integers(0, 2**31)), min_size=1, max_size=14)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])
@given(reqs=arrivals, block_size=st.sampled_from([2, 4]), num_blocks=st.integers(14, 32),
       max_num_seqs=st.integers(2, 6), budget=st.integers(6, 48), prefix_caching=st.booleans(),
       swap_slots=st.sampled_from([0, 4, 64]))   # 0: recompute; 4: the swap space often full
def test_no_lower_priority_runs_while_a_higher_one_that_fits_waits(reqs, block_size, num_blocks,
                                                                   max_num_seqs, budget, prefix_caching,
                                                                   swap_slots):
    """Two tenants, no caps drawn (caps under "priority": test_fair_share's hard-cap test)."""
    pool, sched = make(num_blocks, block_size, max_num_seqs, budget, prefix_caching, swap_slots)
    room = (num_blocks - 1) * block_size
    pending = sorted(((at, k, prio, plen, min(mt, room - plen), seed)
                      for k, (at, prio, plen, mt, seed) in enumerate(reqs) if plen < room), reverse=True)
    shared = [random.Random(0).randrange(1000) for _ in range(24)]   # a common prefix: cache hits
    finished, n = [], 0
    total = len(pending)
    while pending or sched.has_work():
        while pending and pending[-1][0] <= n:
            at, k, prio, plen, mt, seed = pending.pop()
            rng = random.Random(seed)
            prompt = shared[:plen] if seed % 3 == 0 else [rng.randrange(1000) for _ in range(plen)]
            sched.add(request(pool, f"r{k}", prompt, mt, float(at) + k / 100, prio, "ab"[seed % 2]))
        step(sched, finished)
        check_invariants(sched)
        n += 1
        assert n < 2000, "no progress"
    assert len(finished) == total and all(s.num_output_tokens == s.params.max_tokens for s in finished)
    assert pool.num_used == 0 and (sched.kv.swap is None or sched.kv.swap.num_used == 0)


def advance(sched: Scheduler, steps: int) -> None:
    """Run `steps` steps, each sampled token 1 (nothing finishes: the tests set max_tokens above)."""
    for _ in range(steps):
        out = sched.schedule()
        sched.update_from_output(out, lambda: [SampledTokens(c.seq, [1]) for c in out.chunks if c.samples],
                                 lambda s, t: s.token_ids.append(t))


def crowded(policy: str, swap_slots: int = 0):
    """Low-priority work fills the pool; then one urgent request arrives. Returns what happened to it."""
    rng = random.Random(1)
    pool, sched = make(30, 4, 8, 64, True, swap_slots, policy)
    for k in range(4):
        sched.add(request(pool, f"low{k}", [rng.randrange(1000) for _ in range(16)], 40, float(k), 5))
    finished = []
    advance(sched, 12)
    assert pool.num_free <= 4 and len(sched.running) == 4
    urgent = request(pool, "urgent", [rng.randrange(1000) for _ in range(12)], 4, 50.0, 0)
    sched.add(urgent)
    out = sched.schedule()
    return urgent, out, violation(sched, out), sched, finished


def test_fcfs_breaks_the_invariant_the_check_can_fail():
    urgent, out, problem, _, _ = crowded("fcfs")
    assert urgent.status is SequenceStatus.WAITING and not out.preempted
    assert problem is not None and "urgent" in problem


@pytest.mark.parametrize("swap_slots", [0, 64])
def test_an_urgent_request_preempts_the_lowest_priority_newest_first(swap_slots):
    urgent, out, problem, sched, _ = crowded("priority", swap_slots)
    assert problem is None and urgent.status is SequenceStatus.RUNNING
    assert [s.request_id for s in out.preempted][:1] == ["low3"]   # the newest of the lowest first
    assert any(c.seq is urgent for c in out.chunks)
    assert bool(out.swap_out) == bool(swap_slots)
    check_invariants(sched)


def test_equal_priorities_never_preempt_each_other():
    rng = random.Random(2)
    pool, sched = make(24, 4, 8, 64, True, 0)
    for k in range(4):
        sched.add(request(pool, f"a{k}", [rng.randrange(1000) for _ in range(16)], 40, float(k), 1))
    advance(sched, 12)
    late = request(pool, "late", [rng.randrange(1000) for _ in range(12)], 4, 50.0, 1)
    sched.add(late)
    out = sched.schedule()
    assert late.status is SequenceStatus.WAITING and not out.preempted


def test_a_request_too_big_to_fit_preempts_nobody():
    """Feasibility first: preempting every lower request would not make room, so none is preempted."""
    rng = random.Random(3)
    pool, sched = make(24, 4, 8, 64, True, 0)
    sched.add(request(pool, "high-running", [rng.randrange(1000) for _ in range(40)], 40, 0.0, 0))
    sched.add(request(pool, "low", [rng.randrange(1000) for _ in range(16)], 40, 1.0, 5))
    advance(sched, 8)
    big = request(pool, "big", [rng.randrange(1000) for _ in range(60)], 4, 9.0, 1)
    sched.add(big)
    out = sched.schedule()
    assert big.status is SequenceStatus.WAITING and not out.preempted and violation(sched, out) is None
