"""Swap preemption: KV moves to host memory and back, exactly; recompute is the fallback."""
from __future__ import annotations

import torch

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.worker.kv_cache import KVCache, KVSpec
from jupyter_pagedkv.testing.models import random_prompts

MODEL = tiny_model("llama", seed=8)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(8, 256, seed=21)


def unpressured(make_engine) -> list[list[int]]:
    return [o.token_ids for o in make_engine(MODEL, block_size=4).generate(PROMPTS, GREEDY)]


def test_swap_round_trip_restores_blocks_bit_for_bit():
    cache = KVCache(KVSpec(2, 2, 8, torch.float32), num_blocks=6, block_size=4)
    cache.allocate_swap(3)
    cache.k.normal_()
    cache.v.normal_()
    k, v = cache.k[:, [1, 4]].clone(), cache.v[:, [1, 4]].clone()
    cache.swap_out([(1, 2), (4, 0)])
    cache.k.zero_()
    cache.v.zero_()
    cache.swap_in([(2, 5), (0, 3)])
    assert torch.equal(cache.k[:, [5, 3]], k) and torch.equal(cache.v[:, [5, 3]], v)


def test_greedy_output_under_heavy_swapping_equals_the_unpressured_run(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=24, preemption_mode="swap",
                         swap_space="4MiB")
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == unpressured(make_engine)
    assert engine._scheduler.num_swap_outs > 0
    assert engine.stats().num_swapped_blocks == 0 and engine._swap.num_free == engine._swap.num_slots


def test_a_full_swap_space_falls_back_to_recompute(make_engine):
    one_block = KVSpec.from_config(MODEL.config, torch.float32).bytes_per_token * 4
    engine = make_engine(MODEL, block_size=4, num_blocks=24, preemption_mode="swap",
                         swap_space=10 * one_block)   # room for one victim of ~10 blocks
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == unpressured(make_engine)
    assert 0 < engine._scheduler.num_swap_outs < engine._scheduler.num_preemptions


def test_swapped_in_kv_is_what_was_swapped_out(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=24, preemption_mode="swap",
                         swap_space="4MiB")
    cache, seen = engine._kv_cache, {}
    out_fn, in_fn = cache.swap_out, cache.swap_in

    def swap_out(pairs):
        for block, slot in pairs:
            seen[slot] = (cache.k[:, block].clone(), cache.v[:, block].clone())
        out_fn(pairs)

    def swap_in(pairs):
        in_fn(pairs)
        for slot, block in pairs:
            k, v = seen.pop(slot)
            assert torch.equal(cache.k[:, block], k) and torch.equal(cache.v[:, block], v)
            swap_in.checked += 1

    swap_in.checked = 0
    cache.swap_out, cache.swap_in = swap_out, swap_in
    engine.generate(PROMPTS, GREEDY)
    assert swap_in.checked > 0 and not seen


def test_aborting_a_swapped_request_frees_its_host_slots(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=24, preemption_mode="swap",
                         swap_space="4MiB")
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while not engine._scheduler.swapped:
        engine.step()
    engine.check_invariants()
    victim = engine._scheduler.swapped[0]
    assert engine.abort(victim.request_id)
    engine.check_invariants()
    for rid in ids:
        engine.abort(rid)
    assert engine._swap.num_used == 0
