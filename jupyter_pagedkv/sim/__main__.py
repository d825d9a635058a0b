"""`python -m jupyter_pagedkv.sim run|validate`: simulate a production workload, or check the
simulator against the real engine on the embedded model."""
from __future__ import annotations

import argparse
import random
import time

from .plan import GPUS, MODELS
from .workload import PROFILES, synthetic


def _run(args) -> int:
    from .simulator import Simulator

    shape = MODELS[args.model]
    t0 = time.perf_counter()
    reqs = synthetic(args.requests, args.profile, args.rate, args.seed, shape.vocab_size, shape.max_context,
                     args.system_prompt, args.tenants)
    t1 = time.perf_counter()
    sim = Simulator.for_gpu(args.model, args.gpu, args.num_gpus, args.block_size, allocator=args.allocator,
                            preemption_mode=args.preemption, max_num_seqs=args.max_num_seqs)
    res = sim.run(reqs, f"{args.allocator}/{args.preemption}")
    t2 = time.perf_counter()
    print(f"{args.model} on {args.num_gpus} x {args.gpu}: {sim.config.num_blocks:,} blocks of {args.block_size}; "
          f"{args.requests:,} {args.profile} requests at {args.rate} req/s")
    print(res.summary.line())
    print(f"{res.num_steps:,} steps simulated in {t2 - t1:.1f} s (workload built in {t1 - t0:.1f} s)")
    return 0


def chat_prompts(engine, n: int, seed: int, max_tokens: tuple[int, int]) -> list[list[int]]:
    from .workload import chat_requests

    return [engine.apply_chat_template(r.messages) for r in chat_requests(n, seed, *max_tokens)]


def _validate(args) -> int:
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine
    from .serve import TimedPrompt
    from .validate import calibrate, offline_check, timing_check
    from .workload import arrivals

    import torch
    print(f"threads: {torch.get_num_threads()}; loading the embedded model ...", flush=True)
    engine = Engine.from_pretrained(None, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs)
    lo, hi = args.max_tokens

    def timed(seed: int, times: list[float]) -> list[TimedPrompt]:
        rng = random.Random(seed)
        prompts = chat_prompts(engine, len(times), seed, (lo, hi))
        return [TimedPrompt(f"s{seed}-{i}", t, p, SamplingParams(max_tokens=rng.randint(lo, hi), temperature=0.0))
                for i, (t, p) in enumerate(zip(times, prompts))]

    print(f"1. offline batch: {args.requests} requests at once, {args.num_blocks} blocks of {engine.block_size}",
          flush=True)
    check, trace = offline_check(engine, timed(0, [0.0] * args.requests))
    print("  ", check.line())
    cost = calibrate(engine, trace)
    print(f"   cost model fitted to its {len(trace)} measured steps: {cost.describe()}")
    times = arrivals(args.requests, args.rate, random.Random(1))
    print(f"2. Poisson arrivals at {args.rate} req/s: {args.requests} new requests, real vs simulated", flush=True)
    real, sim = timing_check(engine, timed(1, times), cost)
    print("  ", real.line())
    print("  ", sim.line())
    err_total = sim.duration_s / real.duration_s - 1
    err_p50 = sim.latency(50) / real.latency(50) - 1
    print(f"   total time: real {real.duration_s:.1f} s, simulated {sim.duration_s:.1f} s ({err_total:+.1%}); "
          f"P50 latency: real {real.latency(50):.2f} s, simulated {sim.latency(50):.2f} s ({err_p50:+.1%})")
    ok = check.identical and abs(err_total) <= 0.2 and abs(err_p50) <= 0.2
    print("PASS: same schedule, total time and P50 within 20%" if ok else "FAIL")
    engine.check_invariants()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.sim", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate a workload on a GPU preset")
    r.add_argument("--model", default="Llama-3-70B", choices=sorted(MODELS))
    r.add_argument("--gpu", default="H100-80GB", choices=sorted(GPUS))
    r.add_argument("--num-gpus", type=int, default=4)
    r.add_argument("--requests", type=int, default=10_000)
    r.add_argument("--rate", type=float, default=10.0, help="Poisson arrivals, requests/s (0: all at once)")
    r.add_argument("--profile", default="sharegpt", choices=sorted(PROFILES))
    r.add_argument("--allocator", default="paged", choices=("paged", "contiguous"))
    r.add_argument("--preemption", default="recompute", choices=("recompute", "swap"))
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--max-num-seqs", type=int, default=1024)
    r.add_argument("--system-prompt", type=int, default=0, help="tokens of a per-tenant shared system prompt")
    r.add_argument("--tenants", type=int, default=1)
    r.add_argument("--seed", type=int, default=0)
    v = sub.add_parser("validate", help="check the simulator against the real engine (embedded model)")
    v.add_argument("--requests", type=int, default=16)
    v.add_argument("--rate", type=float, default=0.5)
    v.add_argument("--num-blocks", type=int, default=64, help="small, so the offline batch must preempt")
    v.add_argument("--max-num-seqs", type=int, default=64)
    v.add_argument("--max-tokens", type=int, nargs=2, default=(16, 96), metavar=("LO", "HI"))
    args = ap.parse_args(argv)
    return _run(args) if args.cmd == "run" else _validate(args)


if __name__ == "__main__":
    raise SystemExit(main())
