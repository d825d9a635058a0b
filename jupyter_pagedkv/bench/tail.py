"""`python -m jupyter_pagedkv.bench tail`: paged vs contiguous KV under a request-rate sweep.

Two scales in one command, same method at both: the same seeded Poisson workload is served with
the paged allocator and with the contiguous baseline (prefix caching off for both, so memory
management is the only difference), at each rate of a sweep, and each run reports KV
utilisation (tokens stored / slots reserved, time-weighted), max concurrent requests, throughput
and P50/P99 TTFT and end-to-end latency; then swap vs recompute preemption under pressure.

- real: the embedded model on this CPU, driven in wall-clock time (small: tens of requests, each
        carrying earlier chat turns the model itself answered, as real chat traffic does);
- sim:  Llama-3-70B on H100-80GB GPUs through the simulator (the engine's own scheduler and
        block pool; thousands of requests), plus one 10,000-request run timed end to end.

The headline is the rate each allocator sustains under a tail bound (interpolated between the
swept rates), on end-to-end latency and on time to first token (the interactive SLO: how long a
user waits before anything streams; contiguous reservation hurts it first, because requests queue
for a reservation). The tail is P99, or the maximum for runs of fewer than 20 requests.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from ..sim.summary import RunSummary
from ..sim.tail_sweep import report, tail_figure


# -- the simulated scale ------------------------------------------------------------------------
def sim_scale(args) -> dict:
    from ..sim.plan import MODELS
    from ..sim import Simulator, synthetic

    shape = MODELS[args.model]
    preset = dict(model=args.model, gpu=args.gpu, num_gpus=args.num_gpus, max_num_seqs=args.max_num_seqs,
                  enable_prefix_caching=False)
    workload = lambda rate, n=args.sim_requests: synthetic(n, args.profile, rate, args.seed, shape.vocab_size,
                                                           shape.max_context)
    head = Simulator.for_gpu(**preset)
    print(f"\n== simulated: {args.model} on {args.num_gpus} x {args.gpu} ({head.config.num_blocks:,} blocks "
          f"of 16), {args.sim_requests:,} {args.profile}-shaped requests per rate ==", flush=True)
    runs: dict[str, list[RunSummary]] = {"paged": [], "contiguous": []}
    for rate in args.sim_rates:
        reqs = workload(rate)
        for alloc in runs:
            s = Simulator.for_gpu(allocator=alloc, **preset).run(reqs, f"sim {alloc} @ {rate:g}/s").summary
            runs[alloc].append(s)
            print("  " + s.line(), flush=True)
    pressure_rate = args.sim_pressure_rate or args.sim_rates[-1]
    print(f"  preemption under pressure (paged, {pressure_rate:g} req/s):")
    reqs = workload(pressure_rate)
    preempt = {}
    for mode in ("recompute", "swap"):
        s = Simulator.for_gpu(preemption_mode=mode, **preset).run(reqs, f"sim {mode} @ {pressure_rate:g}/s").summary
        preempt[mode] = s
        print("    " + s.line(), flush=True)
    scale = None
    if args.sim_scale_check:
        reqs = workload(args.sim_scale_rate, args.sim_scale_check)
        t0 = time.perf_counter()
        res = Simulator.for_gpu(**preset).run(reqs, f"sim paged {args.sim_scale_check:,} requests")
        wall = time.perf_counter() - t0
        scale = {"requests": args.sim_scale_check, "rate": args.sim_scale_rate, "wall_s": wall,
                 "steps": res.num_steps, "simulated_s": res.summary.duration_s}
        print(f"  scale check: {args.sim_scale_check:,} requests ({res.num_steps:,} steps, "
              f"{res.summary.duration_s:,.0f} s simulated) in {wall:.1f} s of wall time", flush=True)
    return {"label": f"simulated {args.model} on {args.num_gpus} x {args.gpu}", "rates": args.sim_rates,
            "runs": runs, "preempt": preempt, "pressure_rate": pressure_rate, "bound": args.sim_p99_bound,
            "ttft_bound": args.sim_ttft_bound, "scale": scale}


# -- the real scale -------------------------------------------------------------------------------
def real_scale(args) -> dict:
    import torch

    from ..sim.workload import chat_requests, with_history
    from ..engine.engine import Engine
    from ..worker.loader import load_model
    from ..core.sampling_params import SamplingParams
    from ..sim.serve import TimedPrompt, serve
    from ..sim.workload import arrivals

    print(f"\n== real: the embedded model on this CPU ({torch.get_num_threads()} threads), "
          f"{args.real_requests} chat requests per rate, {args.real_num_blocks} blocks of 16 ==", flush=True)
    loaded = load_model(None, torch.float32, torch.device("cpu"))

    def engine(allocator: str, num_blocks: int, preemption: str = "recompute") -> Engine:
        return Engine(loaded.model, loaded.tokenizer, name=loaded.name, num_blocks=num_blocks,
                      allocator=allocator, enable_prefix_caching=False, preemption_mode=preemption,
                      swap_space="256MiB")

    probe = engine("paged", 512)
    requests = chat_requests(args.real_requests, args.seed)
    conversations = with_history(probe, requests, args.real_history_turns, args.real_history_tokens)
    prompts = [probe.apply_chat_template(c) for c in conversations]
    probe.check_invariants()
    del probe
    print(f"  prompts: {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({args.real_history_turns} earlier turns each, replies by the model itself)", flush=True)
    params = SamplingParams(max_tokens=args.real_max_tokens, temperature=0.0)

    def timed(rate: float) -> list[TimedPrompt]:
        times = arrivals(len(prompts), rate, random.Random(args.seed))
        return [TimedPrompt(f"r{i}", t, p, params) for i, (t, p) in enumerate(zip(times, prompts))]

    runs: dict[str, list[RunSummary]] = {"paged": [], "contiguous": []}
    texts: dict[str, list] = {}
    for rate in args.real_rates:
        for alloc in runs:   # alternate, so drifting machine load hits both alike
            eng = engine(alloc, args.real_num_blocks)
            s, outs = serve(eng, timed(rate), f"real {alloc} @ {rate:g}/s")
            eng.check_invariants()
            runs[alloc].append(s)
            texts.setdefault(alloc, []).append([outs[f"r{i}"].token_ids for i in range(len(prompts))])
            print("  " + s.line(), flush=True)
    same = all(a == b for a, b in zip(texts["paged"], texts["contiguous"]))
    print(f"  outputs identical across allocators at every rate: {same}")
    pressure_rate = args.real_pressure_rate or args.real_rates[-1]
    print(f"  preemption under pressure (paged, {args.real_pressure_blocks} blocks, {pressure_rate:g} req/s):")
    preempt = {}
    for mode in ("recompute", "swap"):
        eng = engine("paged", args.real_pressure_blocks, mode)
        s, _ = serve(eng, timed(pressure_rate), f"real {mode} @ {pressure_rate:g}/s")
        eng.check_invariants()
        preempt[mode] = s
        print("    " + s.line(), flush=True)
    return {"label": "real: embedded SmolLM2-135M on this CPU", "rates": args.real_rates, "runs": runs,
            "preempt": preempt, "pressure_rate": pressure_rate, "bound": args.real_p99_bound,
            "ttft_bound": args.real_ttft_bound, "identical_outputs": same}


# -- report ---------------------------------------------------------------------------------------


def plot(scale: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = tail_figure(scale)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  plot: {path}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench tail", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=("both", "real", "sim"), default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-dir", default="docs", help="where the PNG plots go")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    g = ap.add_argument_group("simulated scale")
    g.add_argument("--model", default="Llama-3-70B")
    g.add_argument("--gpu", default="H100-80GB")
    g.add_argument("--num-gpus", type=int, default=2, help="tensor parallel (70B bf16 needs >= 2 x 80 GB)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--profile", default="sharegpt", choices=("sharegpt", "alpaca"))
    g.add_argument("--sim-requests", type=int, default=600)
    g.add_argument("--sim-rates", type=float, nargs="+", default=[0.25 * k for k in range(1, 15)],
                   help="fine enough to interpolate where a tail crosses its bound (default 0.25 .. 3.5)")
    g.add_argument("--sim-p99-bound", type=float, default=60.0, help="end-to-end, seconds")
    g.add_argument("--sim-ttft-bound", type=float, default=5.0, help="time to first token, seconds")
    g.add_argument("--sim-pressure-rate", type=float, default=None)
    g.add_argument("--sim-scale-check", type=int, default=10_000, help="0 skips the timed big run")
    g.add_argument("--sim-scale-rate", type=float, default=2.0)
    g = ap.add_argument_group("real scale (embedded model, CPU)")
    g.add_argument("--real-requests", type=int, default=12)
    g.add_argument("--real-rates", type=float, nargs="+", default=[0.1, 0.2, 0.4, 0.8, 1.6])
    g.add_argument("--real-num-blocks", type=int, default=96)
    g.add_argument("--real-max-tokens", type=int, default=256, help="the client's cap (what contiguous reserves)")
    g.add_argument("--real-p99-bound", type=float, default=60.0, help="end-to-end, seconds")
    g.add_argument("--real-ttft-bound", type=float, default=5.0, help="time to first token, seconds")
    g.add_argument("--real-history-turns", type=int, default=2,
                   help="earlier exchanges in each request's conversation (0: single questions)")
    g.add_argument("--real-history-tokens", type=int, default=96, help="longest earlier reply")
    g.add_argument("--real-pressure-blocks", type=int, default=48)
    g.add_argument("--real-pressure-rate", type=float, default=1.2)
    args = ap.parse_args(argv)

    results = {}
    for name, fn in (("sim", sim_scale), ("real", real_scale)):
        if args.scale in ("both", name):
            scale = fn(args)
            results[name] = report(scale)
            plot(scale, Path(args.plot_dir) / f"tail_{name}.png")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
