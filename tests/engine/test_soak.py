"""The soak benchmark's short, seeded version: a few hundred requests of every kind (samples,
beams, speculation, long prompts, shared prefixes), random aborts and injected step failures
under swap and recompute preemption, the invariants checked after every step; every request
accounted for, no block and no swap slot left held. Replayable: the driver steps the engine."""
from __future__ import annotations

import logging

import pytest

from jupyter_pagedkv.testing.soak import soak


@pytest.mark.timeout(1800)   # ~65 s of CPU; 6 min on a machine shared five ways
def test_a_short_seeded_soak_ends_clean(caplog):
    caplog.set_level(logging.CRITICAL)           # the injected failures log one line per request
    report = soak(num_requests=250, seed=7, warmup=50)
    print("\n".join(report.lines()))
    assert report.violations == []
    assert sum(report.outcomes.values()) == report.requests == 300
    assert report.blocks_referenced == 0 and report.swap_slots_held == 0
    # The run went where it should: every path was taken.
    assert report.outcomes["failed"] > 0 and report.outcomes["aborted"] > 0
    assert report.injected_failures > 0 and report.stats.num_swap_outs > 0
    assert report.stats.spec_accepted_tokens > 0
    assert set(report.kinds) == {"greedy", "sampled", "samples", "beams", "speculative", "long"}
    assert report.ok
