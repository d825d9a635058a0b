"""The batched sampler: the distribution it draws from, seeds that ignore the batch, greedy rows,
and one host sync a step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.worker import sampler as sampler_module
from jupyter_pagedkv.worker.sampler import Sampler, race, row_argmax

LOGITS = [3.0, 2.6, 2.1, 1.5, 1.2, 0.4, -0.3, -1.0]
# Each group makes one knob bind: ignoring it, or moving its cut by one token, changes the
# distribution (see target()): temperature + top-k, top-k + top-p, temperature + min-p, all four.
GROUPS = [
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.9),
    SamplingParams(temperature=1.5, min_p=0.2),
    SamplingParams(temperature=1.2, top_k=7, top_p=0.9, min_p=0.25),
]


@dataclass
class Row:
    """What the sampler reads of a sequence."""
    params: SamplingParams
    generator: torch.Generator | None = None


def seeded(seed: int, **knobs) -> Row:
    return Row(SamplingParams(seed=seed, **knobs), torch.Generator().manual_seed(seed))


def target(logits: list[float], p: SamplingParams) -> np.ndarray:
    """The exact distribution, in float64, written from the definitions: temperature, keep the k
    most likely, keep the smallest prefix whose mass reaches top_p, drop tokens under min_p x the
    most likely one's probability (each on the distribution the step before left)."""
    z = np.asarray(logits, dtype=np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    keep[order[:p.top_k] if p.top_k > 0 else order] = True

    def renormalised() -> np.ndarray:
        w = np.where(keep, np.exp(z - z.max()), 0.0)
        return w / w.sum()

    probs = renormalised()
    mass = 0.0
    for i in order:
        if mass >= p.top_p:
            keep[i] = False
        mass += probs[i]
    probs = renormalised()
    keep &= probs >= p.min_p * probs.max()
    return renormalised()


def chi_square_p_value(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test over the tokens the target keeps; drawing one it excludes scores 0."""
    support = expected > 0
    if counts[~support].any():
        return 0.0
    n = counts.sum()
    stat = float((((counts - n * expected) ** 2)[support] / (n * expected[support])).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def groups_off_target(per_group: int = 5000) -> list[SamplingParams]:
    """The groups whose draws fail the test: 20,000 rows in one batch, the four groups
    interleaved, from a seeded engine generator, each judged against its exact distribution."""
    rows = [Row(GROUPS[i % len(GROUPS)]) for i in range(per_group * len(GROUPS))]
    tokens = np.array(Sampler(seed=0)(torch.tensor([LOGITS]).repeat(len(rows), 1), rows))
    return [params for g, params in enumerate(GROUPS)
            if chi_square_p_value(np.bincount(tokens[g::len(GROUPS)], minlength=len(LOGITS)),
                                  target(LOGITS, params)) <= 1e-4]


def test_the_draws_follow_temperature_top_k_top_p_and_min_p():
    assert groups_off_target() == []


MUTANTS = {
    "temperature ignored": dict(temperature=lambda p: 1.0),
    "top-k ignored": dict(top_k=lambda p: 0),
    "top-k one too many": dict(top_k=lambda p: p.top_k + 1 if p.top_k else 0),
    "top-p ignored": dict(top_p=lambda p: 1.0),
    "min-p ignored": dict(min_p=lambda p: 0.0),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_sampler_that_drops_a_knob_fails_the_distribution_test(monkeypatch, mutant):
    """The test has teeth: the sampler run with one knob broken fails it."""
    real = Sampler.probabilities

    def broken(logits, params):
        changed = [SamplingParams(**{**_knobs(p), **{k: f(p) for k, f in MUTANTS[mutant].items()}})
                   for p in params]
        return real(logits, changed)
    monkeypatch.setattr(Sampler, "probabilities", staticmethod(broken))
    assert groups_off_target() != []


def _knobs(p: SamplingParams) -> dict:
    return dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)


def test_probabilities_match_transformers_warpers():
    """Against transformers' own warpers (temperature, top-k, top-p, min-p, in its order)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 50, generator=g) * 3
    for params in [*GROUPS, SamplingParams(temperature=0.5, top_p=0.6, min_p=0.05),
                   SamplingParams(temperature=2.0, top_k=20, min_p=0.3)]:
        scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
        if params.top_k > 0:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1.0:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
        if params.min_p > 0:
            scores = MinPLogitsWarper(params.min_p)(None, scores)
        ours = Sampler.probabilities(logits, [params] * len(logits))
        assert torch.equal(ours > 0, scores.softmax(-1) > 0), params
        assert torch.allclose(ours, scores.softmax(-1), atol=1e-6), params


def test_the_cuts_and_the_draw_stay_on_the_logits_device():
    """With logits on the `meta` device (a stand-in for CUDA here), a CPU tensor anywhere in the
    cuts or the race raises."""
    probs = Sampler.probabilities(torch.empty(len(GROUPS), 50, device="meta"), GROUPS)
    assert probs.device.type == "meta"
    assert race(probs, torch.empty_like(probs)).device.type == "meta"


def _steps(vocab: int = 64, steps: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(vocab, generator=g) for _ in range(steps)]


def _run(batch: list[Row], position: int, steps: list[torch.Tensor], engine_seed: int) -> list[int]:
    """The tokens of batch[position] over several steps; the other rows get other logits."""
    sampler = Sampler(seed=engine_seed)
    g = torch.Generator().manual_seed(99)
    out = []
    for row_logits in steps:
        logits = torch.randn(len(batch), row_logits.numel(), generator=g)
        logits[position] = row_logits
        out.append(sampler(logits, batch)[position])
    return out


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    steps = _steps()
    knobs = dict(temperature=1.3, top_p=0.95)
    alone = _run([seeded(1234, **knobs)], 0, steps, engine_seed=0)
    assert len(set(alone)) > 2                        # a real draw, not a forced token
    greedy = Row(SamplingParams(temperature=0.0))
    unseeded = Row(SamplingParams(temperature=0.8, top_k=5, min_p=0.1))
    batches = [
        ([greedy, seeded(1234, **knobs), greedy], 1),
        ([seeded(1, **knobs), seeded(2, temperature=0.5), seeded(1234, **knobs)], 2),
        ([unseeded, unseeded, unseeded, seeded(1234, **knobs)], 3),
        ([seeded(1234, **knobs), unseeded, greedy, seeded(5, min_p=0.2), unseeded], 0),
    ]
    for batch, position in batches:
        assert _run(batch, position, steps, engine_seed=len(batch)) == alone, (batch, position)
    assert _run([seeded(4321, **knobs)], 0, steps, engine_seed=0) != alone


def test_greedy_rows_are_the_argmax_of_their_logits():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 300, generator=g)
    batch = [Row(SamplingParams(temperature=0.0)) if i % 3 else seeded(i, temperature=1.0, top_k=4)
             for i in range(9)]
    tokens = Sampler(seed=0)(logits, batch)
    for i, row in enumerate(batch):
        if row.params.greedy:
            assert tokens[i] == int(logits[i].argmax())
    all_greedy = [Row(SamplingParams(temperature=0.0))] * 9
    assert Sampler(seed=0)(logits.to(torch.bfloat16), all_greedy) == \
        logits.to(torch.bfloat16).float().argmax(-1).tolist()


READS = ["tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"]


def test_row_argmax_is_torch_argmax():
    """The CPU's numpy argmax gives ATen's indices: first of equal maxima, NaN the largest, a row of
    -inf at 0, strided views and one 1-D row (a 0-d answer) included; bf16, a tensor that needs
    grad and a negated view go to ATen."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 49152, generator=g)
    x[1, 7] = x[1, 9] = x[1].max() + 1           # a tie: the first wins
    x[2, 40] = x[2, 3] = float("nan")             # NaN counts as the largest, the first of them
    x[3] = float("-inf")
    others = (torch.randn(2, 5, generator=g, requires_grad=True), torch._neg_view(x[:2]))
    for t in (x, x[:, ::3], x[1], x.double(), x.to(torch.bfloat16), *others):
        found = row_argmax(t)
        assert found.dtype == torch.int64 and torch.equal(found, t.argmax(dim=-1)), t.shape


def test_a_step_reads_the_device_once(monkeypatch):
    """Every way a tensor's value reaches Python is counted: a mixed batch (greedy, seeded,
    unseeded; every knob) is read back once, by the final `.tolist()`. The argmax is ATen's, as on
    CUDA (`row_argmax` reads a CPU tensor through numpy: no device there)."""
    monkeypatch.setattr(sampler_module, "row_argmax", lambda x: x.argmax(dim=-1))
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    batch = [Row(SamplingParams(temperature=0.0)), seeded(1, temperature=0.9, top_k=5),
             Row(SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05)), seeded(2, min_p=0.1)]
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0)
    reads.clear()
    tokens = sampler(logits, batch)
    assert reads == ["tolist"] and len(tokens) == 4
