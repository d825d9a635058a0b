"""Padded-bucket decode (what CUDA graphs replay), checked on the CPU: token-identical to
unpadded decode and to transformers across ragged lengths, prefix hits, forks and speculation;
padding rows touch only the scratch block; no host synchronisation in the Triton forward."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import BeamSearchParams, SamplingParams
from jupyter_pagedkv.testing.models import random_prompts
from jupyter_pagedkv.worker.padded_decode import bucket_sizes

MODEL = tiny_model("llama", seed=4)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def pair(make_engine, **kwargs):
    """The same engine twice: unpadded, and decoding in padded buckets."""
    return make_engine(MODEL, **kwargs), make_engine(MODEL, pad_decode=True, **kwargs)


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(5) == [1, 2, 4, 5] and bucket_sizes(1) == [1]


def test_ragged_decode_is_token_identical_to_unpadded_and_to_transformers(make_engine):
    prompts = random_prompts(7, 256, seed=21, lo=1, hi=70)        # 7 rows: bucket 8, one padding row
    plain, padded = pair(make_engine, block_size=8)
    a, b = plain.generate(prompts, GREEDY), padded.generate(prompts, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for p, o in zip(prompts, b):
        assert_same_or_near_tie(MODEL, p, o.token_ids, hf_greedy(MODEL, p, 20, stop_at_eos=False))
    runner = padded._runner
    # Every decode-only step ran padded; each row count went to the smallest bucket that holds it.
    assert runner.padded.num_steps >= 19 and set(runner.padded._batches) <= {1, 2, 4, 8}


def test_prefix_hits_forks_and_beams_decode_identically(make_engine):
    shared = random_prompts(1, 256, seed=3, lo=40, hi=41)[0]
    prompts = [shared + tail for tail in random_prompts(4, 256, seed=5, lo=1, hi=12)]
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, n=3, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    results = []
    for engine in pair(make_engine, block_size=4):
        engine.generate(prompts[:1], GREEDY)                       # the shared prefix is cached now
        outs = engine.generate(prompts[1:], [sampled, GREEDY, sampled])
        found = engine.beam_search(prompts[:2], beams)
        assert sum(o.num_cached_tokens for o in outs) >= 3 * 40 // 4 * 4
        results.append(([[c.token_ids for c in o.outputs] for o in outs],
                        [[(s.token_ids, round(s.score, 5)) for s in b.sequences] for b in found]))
    assert results[0] == results[1]


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculation_decodes_identically(make_engine, draft):
    """Steps that verify drafts are wider than one token per row: they run unpadded, the plain
    decode steps around them padded; the tokens are the same either way."""
    drafter = "ngram" if draft == "ngram" else tiny_model("llama", seed=9)
    base = random_prompts(3, 256, seed=8, lo=10, hi=20)
    prompts = [p + p[:8] + p for p in base]                         # repetition: n-gram drafts hit
    outs = []
    for engine in pair(make_engine, block_size=4, speculative=drafter, num_speculative_tokens=3):
        outs.append([o.token_ids for o in engine.generate(prompts, GREEDY)])
        assert engine.stats().spec_proposed_tokens > 0
    assert outs[0] == outs[1]
    for p, o in zip(prompts, outs[1]):
        assert_same_or_near_tie(MODEL, p, o, hf_greedy(MODEL, p, 20, stop_at_eos=False))


def test_padding_rows_write_only_the_scratch_block(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, pad_decode=True)
    kv = engine._kv_cache
    assert kv.scratch_block == 64 and kv.k.shape[1] == 65        # one block past the pool
    kv.k[:, kv.scratch_block] = 7.0                               # a sentinel: only padding rows write here
    # 3 rows decode in bucket 4: one padding row per step.
    engine.generate(random_prompts(3, 256, seed=2, lo=5, hi=9), SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine._runner.padded.num_steps == 5
    used = {b.block_id for b in engine._pool.blocks if b.block_hash is not None}
    never_used = [i for i in range(64) if i not in used and i >= 16]
    assert never_used and all(float(kv.k[:, i].abs().sum()) == 0.0 for i in never_used)
    assert not (kv.k[:, kv.scratch_block, 0] == 7.0).any()        # slot 0 of scratch: written
    assert (kv.k[:, kv.scratch_block, 1:] == 7.0).all()           # no other slot: never touched


def test_staged_slots_and_lengths_are_each_rows_own(make_engine, monkeypatch):
    """Every padded step's staged slot is `BlockTable.slot` of the row's position and its length
    the position + 1; padding rows hold the scratch slot and length 1. A row whose table lacks the
    block of its position is refused, not sent to the scratch block."""
    from jupyter_pagedkv.core.scheduler import ScheduledChunk

    engine = make_engine(MODEL, block_size=4, num_blocks=96, pad_decode=True)
    padded, staged = engine._runner.padded, []
    fill = padded.fill

    def checked(chunks, size):
        batch = fill(chunks, size)
        pad = size - len(chunks)
        assert batch.slot_mapping.tolist() == \
            [c.seq.block_table.slot(c.start) for c in chunks] + [padded.scratch_slot] * pad
        assert batch.seq_lens.tolist() == [c.start + 1 for c in chunks] + [1] * pad
        staged.append(len(chunks))
        return batch
    monkeypatch.setattr(padded, "fill", checked)
    engine.generate(random_prompts(5, 256, seed=4, lo=3, hi=14), SamplingParams(max_tokens=9, ignore_eos=True))
    assert len(staged) >= 8 and max(staged) == 5
    monkeypatch.undo()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    engine.step()                                   # prefilled: 3 slots in one block
    table = engine._scheduler.running[0].block_table
    longer = SimpleNamespace(token_ids=list(range(12)), block_table=table)   # tokens its table lacks blocks for
    with pytest.raises(RuntimeError, match="past its block table"):
        padded.fill([ScheduledChunk(longer, 9, 1)], 1)   # position 9 is in a third block


class HostSyncs(TorchDispatchMode):
    """Records ops that make the host wait for the device (reading a tensor's value on the host)."""

    SYNCS = ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "equal", "item")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNCS:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def padded_forward_syncs(make_engine, backend: str) -> list[str]:
    engine = make_engine(MODEL, block_size=4, pad_decode=True, attention_backend=backend)
    for p in random_prompts(3, 256, seed=6, lo=3, hi=30):
        engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()                                                   # the prefill
    chunks = engine._scheduler.schedule().chunks                     # a decode-only step
    batch = engine._runner.padded.prepare(chunks)
    assert batch is not None and batch.size == 4
    mode = HostSyncs()
    with torch.inference_mode(), mode:
        engine._runner.padded.run(batch, len(chunks))
    for c in chunks:                                                # leave the engine consistent
        engine._scheduler.finish(c.seq, "abort")
    return mode.found


def test_the_triton_forward_never_waits_for_the_device(make_engine):
    assert padded_forward_syncs(make_engine, "triton") == []
    # The detector itself works: the torch path reads `(slot_mapping < 0).any()` on the host.
    assert "is_nonzero" in padded_forward_syncs(make_engine, "torch")


def test_cuda_graphs_for_a_model_on_the_cpu_is_one_clear_error():
    from jupyter_pagedkv import Engine
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine(MODEL, kv_cache_memory="8MiB", cuda_graphs=True)


class FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: replay writes what `produce` returns."""

    def __init__(self, batch, produce) -> None:
        self.batch, self.produce = batch, produce

    def replay(self) -> None:
        self.batch.logits.copy_(self.produce(self.batch))


def graphs_with(make_engine, monkeypatch, skew: float):
    """An engine whose graphs are fakes replaying the eager logits plus `skew` (0: faithful)."""
    from jupyter_pagedkv.worker.padded_decode import PaddedDecode

    def capture(self, batch):
        batch.logits = self._forward(batch).clone()
        batch.graph = FakeGraph(batch, lambda b: self._forward(b) + skew)
        self.num_captures += 1

    monkeypatch.setattr(PaddedDecode, "_capture", capture)
    engine = make_engine(MODEL, block_size=4, pad_decode=True, max_num_seqs=8)
    engine._runner.padded.capture = True          # what cuda_graphs does on a GPU
    return engine


def test_verified_graphs_replay_and_info_says_so(make_engine, monkeypatch):
    engine = graphs_with(make_engine, monkeypatch, skew=0.0)
    assert engine.warm_up() == len(engine._runner.padded.buckets) == 4
    assert "decode steps as CUDA graphs (4 of 4 buckets captured and verified)" in engine.info().summary
    # Each graph was checked on rows whose contexts reach the longest the buffers hold.
    padded = engine._runner.padded
    assert padded._batches[8].seq_lens.tolist()[-1] == padded.max_blocks * 4
    assert engine.warm_up() == 4                   # a second call captures nothing and still says 4
    prompts = random_prompts(3, 256, seed=31, lo=2, hi=20)
    for p, o in zip(prompts, engine.generate(prompts, GREEDY)):
        assert_same_or_near_tie(MODEL, p, o.token_ids, hf_greedy(MODEL, p, 20, stop_at_eos=False))
    assert engine._runner.padded.num_replays >= 19


def test_a_graph_that_replays_other_logits_turns_graphs_off_with_one_line(make_engine, monkeypatch, caplog):
    engine = graphs_with(make_engine, monkeypatch, skew=0.5)
    with caplog.at_level("WARNING"):
        assert engine.warm_up() == 0
    padded = engine._runner.padded
    assert not padded.capture and padded.num_verified == 0
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "away from the eager step" in lines[0]
    assert "decode steps eager: the CUDA graph of 8 rows replayed logits" in engine.info().summary
    prompts = random_prompts(2, 256, seed=32, lo=2, hi=20)    # still exact, eagerly
    for p, o in zip(prompts, engine.generate(prompts, GREEDY)):
        assert_same_or_near_tie(MODEL, p, o.token_ids, hf_greedy(MODEL, p, 20, stop_at_eos=False))
    assert padded.num_replays == 0


def test_a_capture_error_turns_graphs_off(make_engine, monkeypatch):
    from jupyter_pagedkv.worker.padded_decode import PaddedDecode

    def broken(self, batch):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(PaddedDecode, "_capture", broken)
    engine = make_engine(MODEL, block_size=4, pad_decode=True, max_num_seqs=8)
    engine._runner.padded.capture = True
    assert engine.warm_up() == 0
    assert engine.info().summary.count("capture failed (RuntimeError: operation not permitted when "
                                       "stream is capturing)") == 1


def test_cuda_graphs_default_on_only_where_they_can_run():
    from jupyter_pagedkv.worker.plan import decide_decode_steps

    def steps(graphs, device, backend, pad=False):
        return decide_decode_steps(graphs, pad, torch.device(device), backend).choice
    assert steps(None, "cuda", "triton") == "graphs" and steps(None, "cuda", "torch") == "flat"
    assert steps(None, "cpu", "torch") == "flat" and steps(False, "cuda", "triton") == "flat"
    assert steps(True, "cpu", "torch") == "graphs"    # insisting reaches PaddedDecode's one-line refusal
    assert steps(None, "cpu", "torch", pad=True) == "padded" and steps(False, "cuda", "triton", pad=True) == "padded"
