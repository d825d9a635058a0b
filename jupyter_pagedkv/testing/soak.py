"""`python -m jupyter_pagedkv.bench soak`: thousands of requests of every kind through one engine,
with aborts, injected step failures, preemption by swap and recompute, forks, beams and
speculation, the invariants checked after every step.

What must hold at the end: every request accounted for (finished, aborted or failed), no block
referenced, no swap slot held, no invariant ever broken, and memory that stops growing (the RSS
after the run against the RSS after a warm-up of the same mix). The workload is seeded; with
`--threaded` requests arrive from another thread while the engine's background loop steps
(realistic, not replayable step for step), without it the driver steps the engine itself between
its seeded actions (replayable exactly: the suite's short version runs that way).
"""
from __future__ import annotations

import argparse
import gc
import queue
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..core.sampling_params import BeamSearchParams, SamplingParams
from ..core.stats import EngineStats
from ..worker.host_memory import rss_bytes
from .models import tiny_model


# RSS may grow by at most this much after the warm-up. The warm-up must be long enough to fill
# what is meant to fill (the GEMM primitive caches, 128 shapes each, and the allocator's pools):
# measured 2026-11-30, 3000 requests after a 1000-request warm-up grew RSS by 31 MiB, a second
# run in the same process by 2 MiB; with 50 warm-up requests the first run grew 90 MiB.
MEMORY_BOUND_MIB = 64
WARMUP = 1000


class InjectedFailure(RuntimeError):
    """A step failure the soak injects on purpose (as an out-of-memory error would be)."""


@dataclass
class SoakReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)      # finished / aborted / failed -> requests
    kinds: Counter = field(default_factory=Counter)         # request kind -> requests
    injected_failures: int = 0
    aborts_sent: int = 0
    violations: list[str] = field(default_factory=list)
    stats: EngineStats | None = None                        # the engine's gauges at the end
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    memory_checked: bool = True      # False for short runs: a warm-up too short to fill the caches
    seconds: float = 0.0

    @property
    def blocks_referenced(self) -> int:
        return self.stats.num_used

    @property
    def swap_slots_held(self) -> int:
        return self.stats.num_swapped_blocks

    @property
    def memory_ok(self) -> bool:
        return not self.memory_checked or self.rss_end_mib - self.rss_warm_mib < MEMORY_BOUND_MIB

    @property
    def ok(self) -> bool:
        accounted = sum(self.outcomes.values()) == self.requests
        return (accounted and not self.violations and self.blocks_referenced == 0
                and self.swap_slots_held == 0 and self.memory_ok)

    def lines(self) -> list[str]:
        s = self.stats
        return [f"requests {self.requests} ({dict(self.kinds)}), steps {s.num_steps}, {self.seconds:.1f} s",
                f"outcomes {dict(self.outcomes)}; aborts sent {self.aborts_sent}, injected step failures "
                f"{self.injected_failures}",
                f"preemptions {s.num_preemptions} (swap outs {s.num_swap_outs}); drafts kept "
                f"{s.spec_accepted_tokens}/{s.spec_proposed_tokens}; tokens generated {s.num_generated_tokens}",
                f"invariant violations {len(self.violations)}; blocks referenced at the end "
                f"{self.blocks_referenced}; swap slots held {self.swap_slots_held}",
                f"RSS after warm-up {self.rss_warm_mib:.0f} MiB, at the end {self.rss_end_mib:.0f} MiB "
                f"(growth {self.rss_end_mib - self.rss_warm_mib:+.0f} MiB, bound {MEMORY_BOUND_MIB}"
                + ("" if self.memory_checked else ", not checked: warm-up too short") + ")",
                "OK" if self.ok else "FAILED"]


def _rss_mib() -> float:
    return rss_bytes() / 2**20


def _request(rng: random.Random, shared: list[int], vocab: int) -> tuple[str, list[int], object]:
    """One request of a random kind: its kind, prompt and parameters."""
    kind = rng.choices(["greedy", "sampled", "samples", "beams", "speculative", "long"],
                       weights=[4, 3, 2, 1, 2, 1])[0]
    tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 24))]
    prompt = (shared[:rng.randint(0, len(shared))] + tail) if rng.random() < 0.6 else tail
    if kind == "long":
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(60, 120))]
    max_tokens = rng.randint(1, 40)
    seed = rng.randrange(1 << 30)
    if kind == "beams":
        return kind, prompt, BeamSearchParams(beam_width=rng.randint(2, 3), max_tokens=min(max_tokens, 16))
    if kind == "samples":
        return kind, prompt, SamplingParams(n=rng.randint(2, 3), max_tokens=max_tokens, temperature=0.9,
                                            seed=seed, ignore_eos=rng.random() < 0.5)
    if kind == "speculative":
        repeat = prompt + prompt[: rng.randint(4, 12)] + prompt
        return kind, repeat, SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative="ngram")
    temperature = 0.0 if kind in ("greedy", "long") else 0.8
    return kind, prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                        top_p=0.9 if temperature else 1.0, ignore_eos=rng.random() < 0.7)


def build_engine(model, num_blocks: int = 96, block_size: int = 4, swap_blocks: int = 24):
    from ..engine.engine import Engine
    from ..worker.kv_cache import KVSpec

    spec = KVSpec.from_config(model.config, next(model.parameters()).dtype)
    return Engine(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=16,
                  max_num_batched_tokens=256, preemption_mode="swap",
                  swap_space=swap_blocks * block_size * spec.bytes_per_token, max_model_len=512)


def soak(num_requests: int = 3000, seed: int = 0, threaded: bool = False, failure_rate: float = 0.01,
         abort_rate: float = 0.05, model=None, warmup: int = WARMUP) -> SoakReport:
    """Run the mixed workload; every check is in the returned report (nothing raises for it)."""
    model = model or tiny_model("llama", seed=seed)
    vocab = model.config.vocab_size
    engine = build_engine(model)
    rng, rng_fail = random.Random(seed), random.Random(seed + 1)
    shared = [rng.randrange(3, vocab) for _ in range(32)]
    report = SoakReport(memory_checked=warmup >= WARMUP)

    def check_after_step() -> None:            # in the stepping thread, under the engine lock
        try:
            engine.check_invariants()
        except AssertionError as err:
            report.violations.append(f"after step {engine.num_steps}: {err}")

    real_embedding = model.model.embed_tokens

    class FlakyEmbedding(torch.nn.Module):
        """The model's first module, failing now and then as an out-of-memory error would; every
        way the engine runs a step (its own forward, the lean and C++ loops) starts with it."""

        def __init__(self) -> None:
            super().__init__()
            self.real = real_embedding

        def forward(self, input_ids):
            if rng_fail.random() < failure_rate:
                report.injected_failures += 1
                raise InjectedFailure("injected: the forward ran out of memory")
            return self.real(input_ids)

    engine.add_step_listener(check_after_step)
    model.model.embed_tokens = FlakyEmbedding()
    deltas: queue.SimpleQueue = queue.SimpleQueue()     # every request's deltas: the last says how it ended
    live: set[str] = set()
    t0 = time.perf_counter()

    def collect() -> None:
        while not deltas.empty():
            d = deltas.get()
            if d.finished and d.request_id in live:
                live.discard(d.request_id)
                report.outcomes[_outcome(d)] += 1

    def drive(total: int) -> None:
        submitted = 0
        while submitted < total or live:
            if submitted < total and rng.random() < 0.5:
                for _ in range(min(total - submitted, rng.randint(1, 4))):
                    kind, prompt, params = _request(rng, shared, vocab)
                    live.add(engine.add_request(prompt, params, listener=deltas))
                    report.kinds[kind] += 1
                    report.requests += 1
                    submitted += 1
            if live and rng.random() < abort_rate:
                if engine.abort(sorted(live)[rng.randrange(len(live))]):
                    report.aborts_sent += 1
            if threaded:
                time.sleep(rng.random() * 0.01)
            elif engine.has_unfinished_requests():
                try:
                    engine.step()
                except InjectedFailure:
                    pass                       # the step's requests failed; the engine goes on
            collect()

    if threaded:
        engine.start()
    try:
        drive(warmup)
        gc.collect()
        report.rss_warm_mib = _rss_mib()
        drive(num_requests)
    finally:
        engine.stop()
        model.model.embed_tokens = real_embedding
    gc.collect()
    report.rss_end_mib = _rss_mib()
    report.seconds = time.perf_counter() - t0
    report.stats = engine.stats()
    try:
        engine.check_invariants()
    except AssertionError as err:
        report.violations.append(f"at the end: {err}")
    engine.shutdown()
    return report


def _outcome(delta) -> str:
    """How a request ended, from its last delta: finished, aborted (by us) or failed (injected)."""
    if delta.error is not None:
        return "failed"
    return "aborted" if delta.finish_reason == "abort" else "finished"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threaded", action="store_true", help="requests from another thread, background loop")
    ap.add_argument("--failure-rate", type=float, default=0.01, help="share of steps that fail on purpose")
    ap.add_argument("--abort-rate", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=WARMUP, help="requests before the RSS baseline")
    args = ap.parse_args(argv)
    report = soak(args.requests, args.seed, args.threaded, args.failure_rate, args.abort_rate,
                  warmup=args.warmup)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
