"""Speculative decoding: exact greedy output, the target's distribution when sampling, rollback
that returns blocks at once, adaptive back-off, and the numbers the monitor shows."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import attention, hf_greedy, tiny_model
from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.core.block_pool import BlockPool
from jupyter_pagedkv.core.block_table import BlockTable
from jupyter_pagedkv.decoding.drafters import NgramDrafter, Proposal
from jupyter_pagedkv.decoding.speculative import DraftLengthPolicy
from jupyter_pagedkv.decoding.verification import verify_greedy, verify_sampled

VOCAB = 64
MODEL = tiny_model("llama", vocab=VOCAB, seed=3)
SAME_DRAFT = tiny_model("llama", vocab=VOCAB, seed=3)    # same weights: drafts are mostly kept
OTHER_DRAFT = tiny_model("llama", vocab=VOCAB, seed=4)   # unrelated weights: drafts mostly rejected
# Repetitive prompts give the n-gram lookup something to find; the others mostly do not.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7],
           list(range(3, 40)),
           [9, 9, 9, 9, 9, 9],
           [20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
           [40, 3, 17, 33, 8, 61, 12]]
MAX_TOKENS = 24


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


# The oracle: transformers' own greedy generate (never the engine's own output).
REFERENCE = [hf_greedy(MODEL, p, MAX_TOKENS, stop_at_eos=False) for p in PROMPTS]


# -- drafters and rules, alone -----------------------------------------------------------------------

def test_ngram_lookup_continues_the_most_recent_longest_match():
    d = NgramDrafter(min_n=2, max_n=3)
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]     # latest "1 2 3" wins
    assert d.lookup([1, 2, 5, 9, 9, 4, 2, 5], 3) == [9, 9, 4]           # bigram fallback
    assert d.lookup([1, 2, 3, 4], 3) == []                               # no repeat, no draft
    assert d.lookup([8, 8], 4) == []                                     # too short for min_n


def test_greedy_verification_keeps_the_matching_prefix_and_adds_the_targets_token():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 4, 5, 6]):
        logits[row, tok] = 5.0
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 5, 6]      # all kept + bonus
    assert verify_greedy(logits, [3, 9, 5]) == [3, 4]            # first mismatch -> target's token
    assert verify_greedy(logits, [0, 4, 5]) == [3]


def _chi_square_ok(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, float]:
    """Pearson's statistic (cells with expected < 5 merged) and its 0.1% critical value
    (Wilson-Hilferty approximation of the chi-square quantile)."""
    expected = (probs * n).tolist()
    stat, rest_obs, rest_exp, cells = 0.0, 0, 0.0, 0
    for tok, e in enumerate(expected):
        if e < 5:
            rest_obs, rest_exp = rest_obs + counts.get(tok, 0), rest_exp + e
        else:
            stat += (counts.get(tok, 0) - e) ** 2 / e
            cells += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)
        cells += 1
    df = cells - 1
    z = 3.09   # one-sided 0.1%
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-model", "ngram"])
def test_rejection_sampling_emits_the_targets_distribution(deterministic):
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    q = torch.tensor([0.05, 0.05, 0.1, 0.6, 0.1, 0.1])        # far from p: a wrong rule shows
    params = SamplingParams(temperature=1.0)
    p = p_logits[0].softmax(-1)
    assert 0.5 * float((p - q).abs().sum()) > 0.4
    gen = torch.Generator().manual_seed(1234)
    draw = torch.Generator().manual_seed(99)
    counts, n = Counter(), 2000
    drafts = [3] * n if deterministic else torch.multinomial(q, n, replacement=True, generator=draw).tolist()
    for d in drafts:
        out = verify_sampled(p_logits, [d], None if deterministic else q.unsqueeze(0), params, gen)
        counts[out[0]] += 1
    stat, critical = _chi_square_ok(counts, p, n)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: {sorted(counts.items())}"


def test_policy_backs_off_when_drafts_are_rejected_and_recovers_when_kept():
    policy = DraftLengthPolicy()
    assert policy.draft_len(4) >= 3                      # optimistic start

    def run(steps: int, kept: int) -> list[int]:
        lens = []
        for _ in range(steps):
            k = policy.draft_len(4, 1, lambda extra: 1.5)
            if k:
                policy.update(k, min(k, kept))
            lens.append(k)
        return lens

    lens = run(60, kept=0)[10:]
    assert lens.count(0) >= 45, lens                     # nearly silent...
    assert 0 < sum(lens) <= len(lens) - 45, lens         # ...but still probing, one draft at a time
    gaps = [b - a for a, b in itertools.pairwise(i for i, k in enumerate(lens) if k)]
    assert gaps == sorted(gaps)                          # waits grow between failed probes
    lens = run(60, kept=4)
    assert lens[-1] >= 3, lens                           # kept drafts bring speculation back


def test_policy_weighs_acceptance_against_the_measured_cost_of_drafts():
    likely, unlikely = DraftLengthPolicy(accepted=9, rejected=1), DraftLengthPolicy(accepted=1, rejected=2)
    assert likely.best_len(4, 1, lambda k: 1.0 + 0.05 * k) == 4      # GPU-like: drafts nearly free
    assert likely.best_len(4, 1, lambda k: 2.0) == 4                 # CPU-like: still pays
    assert unlikely.best_len(4, 1, lambda k: 1.0 + 0.05 * k) >= 1
    assert unlikely.best_len(4, 1, lambda k: 2.0) == 0               # 2x cost, few kept: do not
    assert likely.best_len(4, 32, lambda k: 1.0 + 0.2 * k) == 0      # a big batch gains little


def test_rollback_frees_emptied_blocks_at_once():
    pool = BlockPool(8, 4)
    table = BlockTable(pool)
    table.grow(5, [])                  # 2 blocks
    table.grow(5 + 6, [])              # drafts spill into a third block
    assert len(table.blocks) == 3 and pool.num_free == 5
    table.rollback(6)                  # one draft kept
    assert len(table.blocks) == 2 and pool.num_free == 6 and table.num_slots == 6


# -- in the engine -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["ngram", "same-draft", "other-draft"])
@pytest.mark.parametrize("num_blocks", [256, 20], ids=["roomy", "preempting"])
def test_greedy_speculation_is_token_identical_in_a_mixed_batch(make_engine, spec, num_blocks):
    draft = {"ngram": "ngram", "same-draft": SAME_DRAFT, "other-draft": OTHER_DRAFT}[spec]
    engine = make_engine(MODEL, block_size=4, num_blocks=num_blocks, speculative=draft,
                         num_speculative_tokens=4)
    # Every other request opts out: speculative and plain sequences share the steps.
    params = [greedy(speculative=False) if i % 2 else greedy() for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == REFERENCE
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 0
    if spec != "other-draft":
        assert stats.spec_accepted_tokens > 0
    if num_blocks == 20:
        assert engine._scheduler.num_preemptions > 0
    assert all(b.ref_count == 0 for b in engine._pool.blocks)


@pytest.mark.parametrize("spec", ["ngram", "same-draft"])
def test_greedy_speculation_under_swap_preemption_is_transformers_greedy(make_engine, spec):
    from jupyter_pagedkv.worker.kv_cache import KVSpec
    per_block = KVSpec.from_config(MODEL.config, torch.float32).bytes_per_token * 4
    draft = {"ngram": "ngram", "same-draft": SAME_DRAFT}[spec]
    engine = make_engine(MODEL, block_size=4, num_blocks=20, speculative=draft, num_speculative_tokens=4,
                         preemption_mode="swap", swap_space=40 * per_block)
    outs = engine.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == REFERENCE
    assert engine._scheduler.num_swap_outs > 0 and engine.stats().spec_accepted_tokens > 0


def test_per_request_drafter_on_an_engine_without_a_default(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    outs = engine.generate(PROMPTS[:2], [greedy(), greedy(speculative="ngram")])
    assert [o.token_ids for o in outs] == REFERENCE[:2]
    assert engine.stats().spec_proposed_tokens > 0 and engine._speculator.default is None


def test_sampled_requests_speculate_with_ngram_and_return_every_block(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=24, speculative="ngram")
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert engine.stats().spec_proposed_tokens > 0
    assert all(b.ref_count == 0 for b in engine._pool.blocks)


def test_stop_inside_accepted_drafts_discards_the_rest_and_frees_everything(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, speculative=SAME_DRAFT)
    stop_at = REFERENCE[0][6]
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                    stop_token_ids=[stop_at]))[0]
    assert out.token_ids == REFERENCE[0][:REFERENCE[0].index(stop_at) + 1]
    assert out.finish_reason == "stop"
    assert all(b.ref_count == 0 for b in engine._pool.blocks)


def test_stats_and_snapshot_expose_acceptance(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, speculative="ngram")
    engine.generate(PROMPTS[0], greedy())
    s = engine.stats()
    assert 0 < s.spec_accepted_tokens <= s.spec_proposed_tokens
    assert s.spec_acceptance_rate == pytest.approx(s.spec_accepted_tokens / s.spec_proposed_tokens)
    assert s.spec_mean_accepted_length == pytest.approx(s.spec_accepted_tokens / s.spec_num_verifications)
    assert "speculative:" in s.summary()
    snap = engine.pool_snapshot()["speculative"]
    assert snap["proposed"] == s.spec_proposed_tokens and snap["accepted"] == s.spec_accepted_tokens
    assert {"last_step_draft_slots", "last_step_rolled_back_slots", "last_step_freed_blocks"} <= set(snap)


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative=42), "speculative must be"),
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative=tiny_model("llama", vocab=VOCAB + 1)), "vocabulary"),
])
def test_bad_speculative_options_are_refused_with_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, None, num_blocks=8, **kwargs)
    with pytest.raises(ValueError, match="speculative must be"):
        SamplingParams(speculative=3)


# -- random accept / reject patterns -----------------------------------------------------------------

class ScriptedDrafter:
    """Proposes the true continuation with a scripted number of correct tokens, then a wrong one."""

    name = "scripted"
    needs_slots = False

    def __init__(self, pattern: list[int]) -> None:
        self.pattern = itertools.cycle(pattern)

    def propose(self, seqs, ks, copies=()):
        out = []
        for seq, k in zip(seqs, ks):
            full = PROMPTS[int(seq.request_id)] + REFERENCE[int(seq.request_id)]
            truth = full[seq.num_tokens:seq.num_tokens + k]
            good = next(self.pattern)
            out.append(Proposal((truth[:good] + [(t + 1) % VOCAB for t in truth[good:]])[:k]))
        return out

    def rolled_back(self, seq, num_computed):
        pass


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.lists(st.integers(0, 5), min_size=1, max_size=12),
       k=st.integers(1, 5), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(16, 40),
       which=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=5),
       max_tokens=st.integers(2, MAX_TOKENS), abort_after=st.integers(0, 12))
def test_random_accept_reject_patterns_keep_invariants_and_leak_nothing(
        pattern, k, block_size, num_blocks, which, max_tokens, abort_after):
    engine = Engine(MODEL, None, block_size=block_size, num_blocks=num_blocks,
                    speculative=ScriptedDrafter(pattern), num_speculative_tokens=k,
                    enable_prefix_caching=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    for i in dict.fromkeys(which):   # request id = prompt index, so the drafter knows the truth
        try:
            ids.append(engine.add_request(PROMPTS[i], params, request_id=str(i)))
        except ValueError:
            pass   # larger than the whole pool
    aborted, done, steps = None, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_invariants()
        steps += 1
        if steps == abort_after and ids:
            aborted = ids[-1]
            engine.abort(aborted)
            engine.check_invariants()
    for rid in ids:
        if rid != aborted and rid in done:
            assert done[rid] == REFERENCE[int(rid)][:max_tokens]
    assert all(b.ref_count == 0 for b in engine._pool.blocks)
    assert engine._pool.num_free == num_blocks


# -- sampling with speculation follows the target's distribution --------------------------------------

SMALL_VOCAB = 12


def test_seeded_speculative_sampling_matches_the_target_distribution():
    target = tiny_model("llama", vocab=SMALL_VOCAB, seed=11)
    draft = tiny_model("llama", vocab=SMALL_VOCAB, seed=12)
    with torch.no_grad():   # soften the sharpened heads so many tokens are likely
        target.lm_head.weight.mul_(0.25)
        draft.lm_head.weight.mul_(0.25)
    prompt, temp, n = [3, 4, 5, 6, 7, 3, 4], 1.0, 800
    engine = Engine(target, None, block_size=4, num_blocks=2048, max_num_seqs=400, seed=0,
                    speculative=draft, num_speculative_tokens=2)
    engine._speculator.max_step_tokens = 1 << 20   # speculate in large batches too (normally not)
    outs = engine.generate([prompt] * n, [SamplingParams(max_tokens=4, temperature=temp, seed=i,
                                                         ignore_eos=True) for i in range(n)])
    engine.check_invariants()
    stats = engine.stats()
    assert 0.05 < stats.spec_acceptance_rate < 0.95   # both the keep and the residual paths ran
    # Exact marginals of output tokens 2 and 3 under the target alone.
    with torch.no_grad(), attention(target, "sdpa"):
        p1 = (target(torch.tensor([prompt])).logits[0, -1] / temp).softmax(-1)
        firsts = torch.tensor([prompt + [t] for t in range(SMALL_VOCAB)])
        p2 = (target(firsts).logits[:, -1] / temp).softmax(-1)           # [t1, t2]
        pairs = torch.tensor([prompt + [a, b] for a in range(SMALL_VOCAB) for b in range(SMALL_VOCAB)])
        p3 = (target(pairs).logits[:, -1] / temp).softmax(-1).view(SMALL_VOCAB, SMALL_VOCAB, -1)
    marginal2 = p1 @ p2
    marginal3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    for index, marginal in ((1, marginal2), (2, marginal3)):
        counts = Counter(o.token_ids[index] for o in outs)
        stat, critical = _chi_square_ok(counts, marginal, n)
        assert stat < critical, f"token {index + 1}: chi-square {stat:.1f} >= {critical:.1f}"
