"""The GPU check's exactness part: seeded sampled requests (the sampler on the device) and greedy
outputs on both backends against transformers' own `generate` on the same device."""
from __future__ import annotations

from typing import Callable

import torch

from .report import Report, device

# -- exactness --------------------------------------------------------------------------------
def exactness(report: Report, smoke: bool) -> None:
    """Seeded sampled requests first (the sampler on the device: reproducible alone, twice, and
    inside any batch; top_k=1 equal to transformers' greedy), then greedy outputs on both backends
    against transformers `generate` (sdpa) on the same device: token-identical, or the first
    difference a checked near-tie (the oracle's top-2 logit gap below the threshold)."""
    ok = sampled(report, smoke)
    ok &= greedy(report, smoke)
    report.finish(ok, "" if ok else "a check found a difference (rows above)")


THRESHOLD = 1e-3


def _generate(model, backend: str, prompts: list[list[int]], params) -> list[list[int]]:
    from ..engine.engine import Engine

    # As many rows as the batch: graph buckets (captured and verified at build on CUDA) only for it.
    engine = Engine(model, attention_backend=backend, kv_cache_memory="256MiB", pack_weights=False,
                    max_num_seqs=max(1, len(prompts)))
    try:
        outs = engine.generate(prompts, params)
        engine.check_invariants()
    finally:
        engine.shutdown()
    return [o.token_ids for o in outs]


def sampled(report: Report, smoke: bool) -> bool:
    """The sampler on the model's device, with the oracle independent of it: a seeded request's
    tokens must not depend on what shares its batch or on being run again, and top_k=1 at a
    temperature must equal transformers' greedy decoding."""
    from ..core.sampling_params import SamplingParams
    from ..testing.models import compare_with_oracle, hf_greedy, random_prompts, tiny_model

    dev = device()
    backend = "triton"
    new = 8 if smoke else 24
    model = tiny_model("llama").to(dev)
    vocab = model.config.vocab_size
    prompts = random_prompts(6, vocab, seed=11, lo=3, hi=30)
    has_min_p = "min_p" in SamplingParams.__dataclass_fields__
    seeded = SamplingParams(max_tokens=new, temperature=0.8, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    others = [SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=new + 3, temperature=1.0, seed=99, ignore_eos=True),
              SamplingParams(max_tokens=new - 2, temperature=0.7, top_p=0.5, ignore_eos=True),   # unseeded
              SamplingParams(max_tokens=new, temperature=1.3, top_k=5, seed=7, ignore_eos=True,
                             **({"min_p": 0.05} if has_min_p else {}))]
    report.line(f"sampled: tiny llama (vocab {vocab}) fp32 on {dev.type}, {backend} attention, {new} new "
                f"tokens; seeded request: temperature 0.8, top-p 0.9, top-k 40, seed 1234")
    report.line("")
    report.line("| check | result | detail |")
    report.line("|---|---|---|")
    ok = True

    def record(check: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        report.row("sampled", {"check": check, "ok": passed, "detail": detail, "device": dev.type})
        report.line(f"| {check} | {'ok' if passed else 'DIFFERENT'} | {detail} |")

    def attempt(check: str, fn: Callable[[], tuple[bool, str]]) -> None:
        try:
            passed, detail = fn()
        except Exception as err:        # the old sampler raised on CUDA: that is this check's finding
            passed, detail = False, f"raised {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        record(check, passed, detail)

    with torch.inference_mode():
        alone: list[list[int]] = []

        def run_alone() -> tuple[bool, str]:
            alone.extend(_generate(model, backend, [prompts[0]], [seeded]))
            return len(alone[0]) == new and all(0 <= t < vocab for t in alone[0]), f"tokens {alone[0]}"

        def run_twice() -> tuple[bool, str]:
            again = _generate(model, backend, [prompts[0]], [seeded])[0]
            return again == alone[0], f"first difference at {_first_diff(again, alone[0])}" if again != alone[0] else "same"

        def in_batch(order: list[int]) -> Callable[[], tuple[bool, str]]:
            def run() -> tuple[bool, str]:
                ps = [prompts[0] if i < 0 else prompts[1 + i] for i in order]
                params = [seeded if i < 0 else others[i] for i in order]
                outs = _generate(model, backend, ps, params)
                mine = outs[order.index(-1)]
                lengths = all(len(o) == p.max_tokens for o, p in zip(outs, params))
                in_vocab = all(0 <= t < vocab for o in outs for t in o)
                same = mine == alone[0]
                detail = "same" if same else f"first difference at {_first_diff(mine, alone[0])}"
                if not (lengths and in_vocab):
                    detail += "; other requests' lengths or token ids wrong"
                return same and lengths and in_vocab, detail
            return run

        attempt("seeded, alone (draws on the device without raising)", run_alone)
        if alone:
            attempt("seeded, twice in a row", run_twice)
            attempt("seeded, in a batch of 5 (greedy, seeded, unseeded, top-k"
                    f"{', min-p' if has_min_p else ''} neighbours)", in_batch([0, -1, 1, 2, 3]))
            attempt("seeded, in another batch (first, 2 neighbours)", in_batch([-1, 2, 1]))

        def top_k1() -> tuple[bool, str]:
            limits = [new] * 3
            ours = _generate(model, backend, prompts[3:6],
                             [SamplingParams(max_tokens=m, temperature=0.8, top_k=1, seed=3 + i, ignore_eos=True)
                              for i, m in enumerate(limits)])
            refs = [hf_greedy(model, p, m, stop_at_eos=False) for p, m in zip(prompts[3:6], limits)]
            found = [compare_with_oracle(model, p, o, r) for p, o, r in zip(prompts[3:6], ours, refs)]
            wrong = [f for f in found if not f.near_tie(THRESHOLD)]
            return not wrong, (f"{sum(f.identical for f in found)}/3 identical to transformers greedy, "
                               f"{len(found) - len(wrong) - sum(f.identical for f in found)} near-ties")

        attempt("top_k=1 at temperature 0.8 equals transformers greedy", top_k1)
    del model
    _empty_cache()
    report.line("")
    return ok


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy(report: Report, smoke: bool) -> bool:
    from ..core.sampling_params import SamplingParams
    from ..testing.models import TINY_ARCHS, compare_with_oracle, hf_greedy, random_prompts, shaped_model, tiny_model

    dev = device()
    n, new, hi = (2, 6, 20) if smoke else (8, 32, 120)
    cases = [(arch, lambda a=arch: tiny_model(a).to(dev), 256) for arch in TINY_ARCHS]
    cases.append(("smollm2-135m shape" + (", 2 layers" if smoke else ""),
                  lambda: shaped_model("smollm2-135m", torch.float32, dev, num_layers=2 if smoke else None,
                                       sharpen=True), 49152))
    report.line(f"greedy: fp32, {n} prompts of 1-{hi - 1} random tokens, {new} new tokens each, EOS "
                f"ignored; near-tie threshold {THRESHOLD:g} (top-2 logit gap of the oracle)")
    report.line("")
    report.line("| model | backend | identical | near-ties (gap) | wrong |")
    report.line("|---|---|---:|---|---:|")
    ok = True
    for name, build, vocab in cases:
        model = build()
        prompts = random_prompts(n, vocab, seed=7, lo=1, hi=hi)
        refs = [hf_greedy(model, p, new, stop_at_eos=False) for p in prompts]
        for backend in ("triton", "torch"):
            outs = _generate(model, backend, prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
            found = [compare_with_oracle(model, p, o, r) for p, o, r in zip(prompts, outs, refs)]
            same = sum(f.identical for f in found)
            ties = [f for f in found if not f.identical and f.near_tie(THRESHOLD)]
            wrong = [f for f in found if not f.near_tie(THRESHOLD)]
            ok &= not wrong
            report.row("greedy", {"model": name, "backend": backend, "identical": same, "of": n,
                                  "near_ties": len(ties), "wrong": len(wrong),
                                  "gaps": [f.gap for f in found if not f.identical]})
            gaps = ", ".join(f"{f.gap:.1e}" for f in ties)
            report.line(f"| {name} | {backend} | {same}/{n} | {len(ties)}{f' ({gaps})' if gaps else ''} | "
                        f"{len(wrong)} |")
        del model
        _empty_cache()
    return ok


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PARTS = {"exactness": exactness}
