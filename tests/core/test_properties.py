"""Random interleavings of add / step / abort / finish never break the pool's invariants."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import tiny_model
from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.worker.kv_cache import KVSpec

MODEL = tiny_model("llama", vocab=64, seed=5)
BYTES_PER_TOKEN = KVSpec.from_config(MODEL.config, torch.float32).bytes_per_token

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24), st.integers(0, 3), st.integers(0, 2**31)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("reset"),),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25),
       block_size=st.sampled_from([1, 2, 4, 8]),
       num_blocks=st.integers(12, 40),
       budget=st.integers(4, 64),
       prefix_caching=st.booleans(),
       swap_blocks=st.sampled_from([0, 3, 40]))     # 0: recompute; 3: swap space often full
def test_random_interleavings_keep_invariants(ops, block_size, num_blocks, budget, prefix_caching,
                                              swap_blocks):
    swap = dict(preemption_mode="swap", swap_space=swap_blocks * block_size * BYTES_PER_TOKEN) \
        if swap_blocks else {}
    engine = Engine(MODEL, None, block_size=block_size, num_blocks=num_blocks,
                    max_num_batched_tokens=budget, max_num_seqs=6,
                    enable_prefix_caching=prefix_caching, **swap)
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]   # common prefixes make cache hits
    ids: list[str] = []
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, kind, seed = o
            prompt = (shared[: plen] + list(range(20, 20 + plen)))[:plen] if kind else \
                torch.randint(3, 64, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if kind != 3 else 0.8,
                                    seed=kind, ignore_eos=True)
            if -(-(plen + max_tokens) // block_size) > num_blocks:
                with pytest.raises(ValueError, match="blocks"):   # larger than the whole pool
                    engine.add_request(prompt, params)
            else:
                ids.append(engine.add_request(prompt, params))    # anything that fits is admitted
        elif o[0] == "step":
            for _ in range(o[1]):
                engine.step()
                engine.check_invariants()
        elif o[0] == "abort" and ids:
            engine.abort(ids[o[1] % len(ids)])
        elif o[0] == "reset":
            engine.reset_prefix_cache()
        engine.check_invariants()
    while engine.has_unfinished_requests():   # "finish": run everything to completion
        engine.step()
        engine.check_invariants()
    reasons = {s.finish_reason for r in engine._finished for s in r.seqs}
    assert len(engine._finished) == len(ids) and reasons <= {"length", "abort"}
    assert all(b.ref_count == 0 for b in engine._pool.blocks)
    assert engine._pool.num_free == num_blocks
    assert engine._swap is None or engine._swap.num_used == 0
