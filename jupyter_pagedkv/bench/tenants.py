"""`python -m jupyter_pagedkv.bench tenants`: the noisy neighbour, FCFS against fair share.

A quiet tenant sends short chat turns at a steady rate for the whole run; a noisy one sends a
burst of long generations that alone needs more KV than the pool holds (sim/tenant_workload.py).
The same seeded requests are served once with `scheduling_policy="fcfs"` and once with "fair"
(equal weights unless told), and each run reports the quiet tenant's TTFT (P50 and tail) and
end-to-end tail, the noisy tenant's end-to-end tail, each tenant's output tokens/s over its own
span, the pool held (blocks held / pool, time-weighted over busy steps, and the noisy tenant's part
of it) and the preemptions. The tail is P99, or "max" for fewer than 20 requests.

- sim:  Llama-3-70B on 2 x H100-80GB through the simulator (the engine's own scheduler and pool),
        several seeds, each seed's ratio printed;
- real: the embedded model on this CPU (fp32), driven in wall-clock time with the same shape of
        traffic at a small scale, the two policies one after the other in one process.

Checks printed for each: quiet TTFT tail fair / FCFS (the issue asks <= 1/3 in the simulator,
< 1 for real), and noisy tokens/s under fair >= w_noisy / (w_quiet + w_noisy) x under FCFS.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ..sim.tenant_comparison import (POLICIES, RATIO_TARGET_SIM, PolicyRun, TenantedEngine, compare, sim_runs,
                                     tenants_figure)
from ..sim.summary import RequestTiming
from ..sim.tenant_workload import NOISY, QUIET, TenantMix

def table(label: str, cmp: dict) -> None:
    tail = cmp["fcfs"]["quiet"]["tail"]
    ntail = cmp["fcfs"]["noisy"]["tail"]
    print(f"  {label}")
    print(f"    {'policy':<6} {'quiet TTFT p50':>15} {'quiet TTFT ' + tail:>16} {'quiet e2e ' + tail:>15} "
          f"{'noisy e2e ' + ntail:>15} {'quiet tok/s':>12} {'noisy tok/s':>12} {'pool held':>10} "
          f"{'noisy part':>11} {'preempt':>8} {'steps':>7} {'ms/step':>8}")
    for p in POLICIES:
        f = cmp[p]
        print(f"    {p:<6} {f['quiet']['ttft_p50_s']:14.2f}s {f['quiet']['ttft_tail_s']:15.2f}s "
              f"{f['quiet']['e2e_tail_s']:14.2f}s {f['noisy']['e2e_tail_s']:14.1f}s "
              f"{f['quiet']['tokens_per_s']:12.1f} {f['noisy']['tokens_per_s']:12.1f} "
              f"{f['pool_utilisation']:10.1%} {f['noisy_block_share']:11.1%} {f['preemptions']:8d} {f['steps']:7d} "
              f"{f['mean_step_ms']:8.1f}")
    nt = cmp["noisy_throughput"]
    print(f"    quiet TTFT {tail} fair / FCFS = {cmp['quiet_ttft_tail_ratio']:.3f}; noisy tok/s fair "
          f"{nt['fair_tokens_per_s']:.1f} vs FCFS {nt['fcfs_tokens_per_s']:.1f} ({nt['kept']:.0%} kept), floor "
          f"{nt['share']:.2f} x FCFS = {nt['floor_tokens_per_s']:.1f}: {'ok' if nt['ok'] else 'BELOW its share'}",
          flush=True)


# -- the simulated scale ------------------------------------------------------------------------


def sim_scale(args, weights: dict[str, float]) -> tuple[dict, dict[str, PolicyRun]]:
    mix = TenantMix(quiet_requests=args.sim_quiet_requests, quiet_rate=args.sim_quiet_rate,
                    noisy_requests=args.sim_noisy_requests, noisy_at=args.sim_noisy_at)
    preset = dict(model=args.model, gpu=args.gpu, num_gpus=args.num_gpus)
    print(f"\n== simulated: {args.model} on {args.num_gpus} x {args.gpu}; quiet: {mix.quiet_requests} chat turns at "
          f"{mix.quiet_rate:g} req/s (prompt {mix.quiet_prompt[0]}-{mix.quiet_prompt[1]}, output "
          f"{mix.quiet_output[0]}-{mix.quiet_output[1]}); noisy: {mix.noisy_requests} long generations from "
          f"t = {mix.noisy_at:g} s (prompt {mix.noisy_prompt[0]}-{mix.noisy_prompt[1]}, output "
          f"{mix.noisy_output[0]}-{mix.noisy_output[1]}); weights {weights} ==", flush=True)
    seeds, first = [], None
    for seed in args.seeds:
        runs = sim_runs(mix, seed, weights, **preset)
        first = first or runs
        cmp = compare(runs, weights)
        table(f"seed {seed} ({runs['fcfs'].num_blocks} blocks of 16):", cmp)
        seeds.append({"seed": seed, **cmp})
    ratios = [s["quiet_ttft_tail_ratio"] for s in seeds]
    out = {"label": f"simulated {args.model} on {args.num_gpus} x {args.gpu}", "num_blocks": first["fcfs"].num_blocks,
           "workload": mix.__dict__, "weights": weights, "seeds": seeds,
           "quiet_ttft_tail_ratio_median": statistics.median(ratios), "quiet_ttft_tail_ratio_max": max(ratios),
           "ratio_ok": all(r <= RATIO_TARGET_SIM for r in ratios),
           "noisy_throughput_ok": all(s["noisy_throughput"]["ok"] for s in seeds)}
    print(f"  per-seed quiet TTFT tail ratios fair / FCFS: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {out['quiet_ttft_tail_ratio_median']:.3f}; target <= 1/3 at every seed: "
          f"{'ok' if out['ratio_ok'] else 'MISSED'}); noisy throughput within its share at every seed: "
          f"{'ok' if out['noisy_throughput_ok'] else 'NO'}")
    return out, first


# -- the real scale -------------------------------------------------------------------------------


def real_scale(args, weights: dict[str, float]) -> tuple[dict, dict[str, PolicyRun]]:
    import random

    import torch

    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine
    from ..sim.serve import TimedPrompt, serve
    from ..sim.workload import SUBJECTS, arrivals, chat_requests
    from ..worker.loader import load_model

    nq, nn, noisy_tokens = ((12, 6, 160) if args.quick else (args.real_quiet_requests, args.real_noisy_requests,
                                                             args.real_noisy_tokens))
    print(f"\n== real: the embedded model on this CPU ({torch.get_num_threads()} threads, fp32), "
          f"{args.real_num_blocks} blocks of 16; quiet: {nq} chat turns at {args.real_quiet_rate:g} req/s (greedy, "
          f"at most {args.real_quiet_tokens} tokens); noisy: {nn} stories of {noisy_tokens} tokens from "
          f"t = {args.real_noisy_at:g} s; weights {weights} ==", flush=True)
    loaded = load_model(None, torch.float32, torch.device("cpu"))

    def engine(policy: str) -> Engine:
        eng = Engine(loaded.model, loaded.tokenizer, name=loaded.name, num_blocks=args.real_num_blocks,
                     scheduling_policy=policy)
        # Warm up (the process's first forwards are slow) before the clock starts, for each policy alike.
        eng.generate(["Hello."], SamplingParams(max_tokens=4, temperature=0.0))
        for t, w in weights.items():
            eng.set_tenant(t, weight=w)
        return eng

    probe = engine("fcfs")
    quiet = [probe.apply_chat_template(r.messages) for r in chat_requests(nq, args.seed)]
    noisy = [probe.apply_chat_template([{"role": "user", "content": f"Write a long, detailed story about "
                                         f"{SUBJECTS[(3 * i + 1) % len(SUBJECTS)]}."}]) for i in range(nn)]
    del probe
    rng = random.Random(args.seed)
    qp = SamplingParams(max_tokens=args.real_quiet_tokens, temperature=0.0)
    np_ = SamplingParams(max_tokens=noisy_tokens, temperature=0.0, ignore_eos=True)
    prompts = ([TimedPrompt(f"{QUIET}-{i}", t, p, qp) for i, (t, p) in enumerate(zip(arrivals(nq, args.real_quiet_rate, rng), quiet))]
               + [TimedPrompt(f"{NOISY}-{i}", args.real_noisy_at + t, p, np_)
                  for i, (t, p) in enumerate(zip(arrivals(nn, args.real_noisy_rate, rng), noisy))])
    print(f"  prompts: quiet {min(map(len, quiet))}-{max(map(len, quiet))} tokens, noisy "
          f"{min(map(len, noisy))}-{max(map(len, noisy))}", flush=True)
    runs = {}
    for policy in POLICIES:
        tagged = TenantedEngine(engine(policy), (QUIET, NOISY), min(p.arrival_s for p in prompts))
        t0 = time.perf_counter()
        summary, _ = serve(tagged, prompts, f"real {policy}")
        tagged.engine.check_invariants()
        timings = [RequestTiming(t.request_id, t.arrival_s, t.first_token_s, t.finish_s, t.num_output_tokens,
                                 t.request_id.split("-")[0]) for t in summary.requests]
        runs[policy] = PolicyRun(policy, timings, tagged.series, args.real_num_blocks, summary.num_preemptions)
        print(f"  {policy}: {time.perf_counter() - t0:.0f} s of wall time", flush=True)
    cmp = compare(runs, weights)
    table("real:", cmp)
    return {"label": "real: embedded SmolLM2-135M on this CPU", "num_blocks": args.real_num_blocks,
            "threads": torch.get_num_threads(), "weights": weights, **cmp}, runs


# -- figure and command line ----------------------------------------------------------------------


def plot(runs: dict[str, PolicyRun], label: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = tenants_figure(runs, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  plot: {path}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench tenants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=("both", "real", "sim"), default="both")
    ap.add_argument("--seed", type=int, default=0, help="the real run's seed")
    ap.add_argument("--quiet-weight", type=float, default=1.0)
    ap.add_argument("--noisy-weight", type=float, default=1.0)
    ap.add_argument("--plot-dir", default="docs/images", help="where bench_tenants_{sim,real}.png go")
    ap.add_argument("--json", default=None, help="also write the tables to this JSON file")
    ap.add_argument("--quick", action="store_true", help="a smaller real run (12 quiet, 6 noisy of 160 tokens)")
    g = ap.add_argument_group("simulated scale")
    g.add_argument("--model", default="Llama-3-70B")
    g.add_argument("--gpu", default="H100-80GB")
    g.add_argument("--num-gpus", type=int, default=2)
    g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    g.add_argument("--sim-quiet-requests", type=int, default=200)
    g.add_argument("--sim-quiet-rate", type=float, default=1.0)
    g.add_argument("--sim-noisy-requests", type=int, default=16)
    g.add_argument("--sim-noisy-at", type=float, default=10.0)
    g = ap.add_argument_group("real scale (embedded model, CPU, fp32)")
    g.add_argument("--real-num-blocks", type=int, default=48)
    g.add_argument("--real-quiet-requests", type=int, default=24)
    g.add_argument("--real-quiet-rate", type=float, default=0.5)
    g.add_argument("--real-quiet-tokens", type=int, default=32, help="the quiet turns' max_tokens (greedy, EOS)")
    g.add_argument("--real-noisy-requests", type=int, default=8)
    g.add_argument("--real-noisy-at", type=float, default=4.0)
    g.add_argument("--real-noisy-rate", type=float, default=4.0)
    g.add_argument("--real-noisy-tokens", type=int, default=256, help="each story's length (ignore_eos)")
    return ap


def main(argv: list[str]) -> int:
    from ..gpucheck.report import cpu_isa

    args = parser().parse_args(argv)
    weights = {QUIET: args.quiet_weight, NOISY: args.noisy_weight}
    print(f"CPU: {cpu_isa()}")
    results: dict = {"cpu_isa": cpu_isa()}
    for name, fn in (("sim", sim_scale), ("real", real_scale)):
        if args.scale in ("both", name):
            out, runs = fn(args, weights)
            results[name] = out
            plot(runs, out["label"], Path(args.plot_dir) / f"bench_tenants_{name}.png")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float))
    return 0
