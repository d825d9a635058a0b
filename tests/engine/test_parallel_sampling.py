"""SamplingParams(n=N): the prompt is prefilled once and its blocks are shared by N samples."""
from __future__ import annotations

import torch

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams

MODEL = tiny_model("llama", seed=6)
PROMPT = list(range(3, 30))          # 27 tokens: 6 full blocks of 4 and a shared partial one


def test_n_greedy_samples_equal_each_other_and_n_equal_1(make_engine):
    engine = make_engine(MODEL, block_size=4)
    one = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    four = engine.generate([PROMPT], SamplingParams(n=4, max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(four.outputs) == 4
    assert all(o.token_ids == one.token_ids for o in four.outputs)
    assert [o.index for o in four.outputs] == [0, 1, 2, 3]


def test_samples_share_the_prompt_blocks_and_copy_the_partial_one_on_write(make_engine):
    engine = make_engine(MODEL, block_size=4, enable_prefix_caching=False)
    rid = engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=8, temperature=0.8, seed=3,
                                                    ignore_eos=True))
    engine.step()                                  # prefill + fork + first sampled tokens
    stats = engine.stats()
    assert stats.num_shared == 7                   # all 7 prompt blocks are held by 4 tables
    engine.check_invariants()
    engine.step()                                  # each sample writes its token: copy-on-write
    stats = engine.stats()
    assert stats.num_shared == 6                   # the full blocks stay shared
    assert stats.num_used == 6 + 4                 # one private copy of the last block per sample
    engine.check_invariants()
    engine.abort(rid)
    assert engine.stats().num_used == 0


def test_seeded_samples_reproduce_across_runs_and_batch_compositions(make_engine):
    engine = make_engine(MODEL)
    params = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate([PROMPT], params)[0].outputs]
    assert len({tuple(t) for t in alone}) > 1      # different samples, not four copies
    other = SamplingParams(max_tokens=10, temperature=0.7, ignore_eos=True)
    crowd = engine.generate([[7, 8, 9], PROMPT, [10] * 20], [other, params, other])
    assert [o.token_ids for o in crowd[1].outputs] == alone
    single = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=42,
                                                      ignore_eos=True))[0]
    assert single.token_ids == alone[0]            # sample 0 of seed s is the n=1 run of seed s


def test_parallel_samples_survive_preemption(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=14)
    ref = make_engine(MODEL, block_size=4).generate(
        [PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].token_ids
    out = engine.generate([PROMPT], SamplingParams(n=3, max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert engine.stats().num_preemptions > 0
    assert all(o.token_ids == ref for o in out.outputs)


def test_copy_on_write_never_changes_a_siblings_kv(make_engine):
    engine = make_engine(MODEL, block_size=4, enable_prefix_caching=False)
    rid = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=9,
                                                    ignore_eos=True))
    engine.step()                                     # prefill, fork: 3 tables share 7 blocks
    seqs = engine._requests[rid].seqs
    shared = [b.block_id for b in seqs[0].block_table.blocks]
    k0, v0 = engine._kv_cache.k[:, shared].clone(), engine._kv_cache.v[:, shared].clone()
    for _ in range(6):
        engine.step()                                 # each sample writes into its own copy
    tails = [s.block_table.blocks[6].block_id for s in seqs]
    # Two samples copied the shared tail; the last holder of the original writes into it in place.
    assert len(set(tails)) == 3 and shared[6] in tails and not set(tails) & set(shared[:6])
    # The shared blocks were never written: their KV is bit-identical to the fork moment ...
    assert torch.equal(engine._kv_cache.k[:, shared[:6]], k0[:, :6])
    assert torch.equal(engine._kv_cache.v[:, shared[:6]], v0[:, :6])
    # ... and every copied tail starts with the 3 prompt slots it copied, unchanged.
    for t in tails:
        assert torch.equal(engine._kv_cache.k[:, t, :3], k0[:, 6, :3])
        assert torch.equal(engine._kv_cache.v[:, t, :3], v0[:, 6, :3])
    engine.abort(rid)


def test_each_sample_and_beam_takes_a_seat_of_max_num_seqs(make_engine):
    """n=4 requests under max_num_seqs=6: one group of 4 runs at a time (4 + 4 > 6), never more than
    6 sequences, and each group's outputs are the ones it gets alone; the same for beam_width=3."""
    from jupyter_pagedkv import BeamSearchParams
    engine = make_engine(MODEL, block_size=4, max_num_seqs=6)
    params = SamplingParams(n=4, max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    prompts = [PROMPT[i:] for i in range(3)]
    for p in prompts:
        engine.add_request(p, params)
    most, finished = 0, []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        most = max(most, engine.stats().num_running)
    assert 4 <= most <= 6
    alone = make_engine(MODEL, block_size=4).generate(prompts, params)
    by_prompt = {tuple(o.prompt_token_ids): [s.token_ids for s in o.outputs] for o in finished}
    assert [by_prompt[tuple(p)] for p in prompts] == [[s.token_ids for s in o.outputs] for o in alone]
    beams = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, beams)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.stats().num_running)
    assert 3 <= most <= 6
