"""The `graphs` part of the GPU check: decode steps replayed from CUDA graphs against the same
steps run eagerly (padded to the same buckets, and unpadded), token for token, with the speed-up
and where a decode step's time goes. On a CPU (the rehearsal) graphs cannot be captured: the part
checks padded against unpadded decode and says so."""
from __future__ import annotations

import random
import time

import torch

from .report import Report, device
from ..testing.models import shaped_model


def decode_workload(n: int, vocab: int, smoke: bool) -> tuple[list[list[int]], list[int]]:
    """Short prompts and long answers of mixed length: most steps are decode-only, and the batch
    shrinks as requests finish, so several buckets are used."""
    rng = random.Random(7)
    p_lo, p_hi, o_lo, o_hi = (4, 12, 4, 10) if smoke else (32, 64, 64, 192)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(p_lo, p_hi))] for _ in range(n)]
    return prompts, [rng.randint(o_lo, o_hi) for _ in range(n)]


def run(model, prompts, limits, options: dict) -> tuple[list[list[int]], float, dict, dict]:
    """Warm up on the very same workload (kernel compiles; graph captures of every bucket it uses),
    then time it. Returns outputs, seconds, the decode-step breakdown and padded-decode counters."""
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine
    from ..worker.step_timing import summarize

    engine = Engine(model, attention_backend="triton", max_num_seqs=len(prompts), pack_weights=False,
                    kv_cache_memory="4GiB" if torch.cuda.is_available() else "256MiB", **options)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in limits]
    try:
        captures = engine.warm_up()          # every bucket's graph, before anything is timed
        engine.generate(prompts, params)
        engine.step_timings = []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        engine.check_invariants()
        stats = engine.stats()
        counters = {"padded_steps": stats.num_padded_steps, "replays": stats.num_graph_replays,
                    "captures": captures}
        breakdown = summarize(engine.step_timings, min_decode=1)
    finally:
        engine.shutdown()
    return [o.token_ids for o in outs], seconds, breakdown, counters


def graphs(report: Report, smoke: bool) -> None:
    dev = device()
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = shaped_model("smollm2-135m", dtype, dev, num_layers=2 if smoke else None)
    n = 6 if smoke else 64
    prompts, limits = decode_workload(n, model.config.vocab_size, smoke)
    modes = [("eager, unpadded", {"cuda_graphs": False}),
             ("eager, padded buckets", {"cuda_graphs": False, "pad_decode": True})]
    if on_gpu:
        modes.append(("CUDA graphs", {"cuda_graphs": True}))
    report.line(f"SmolLM2-135M shape{', 2 layers' if smoke else ''}, random weights, "
                f"{str(dtype).replace('torch.', '')}, {n} requests (prompts {min(map(len, prompts))}-"
                f"{max(map(len, prompts))}, outputs {min(limits)}-{max(limits)} tokens), greedy, Triton "
                f"attention on {dev.type}; each mode warmed up on the same workload first")
    if not on_gpu:
        report.line("CUDA graphs: not run (no CUDA device); padded against unpadded decode only")
    report.line("")
    report.line("| mode | tokens/s | decode step ms | device forward ms | host share | padded steps | "
                "graph replays |")
    report.line("|---|---:|---:|---:|---:|---:|---:|")
    results, modes_data = {}, {}
    for name, options in modes:
        outs, seconds, b, counters = run(model, prompts, limits, options)
        results[name] = outs
        ms = lambda k: f"{b[k] * 1e3:.2f}" if b.get(k) is not None else "-"
        share = f"{b['host_fraction']:.0%}" if "host_fraction" in b else "-"
        report.line(f"| {name} | {sum(limits) / seconds:.0f} | {ms('total_s')} | {ms('device_s')} | {share} | "
                    f"{counters.get('padded_steps', 0)} | {counters.get('replays', 0)} |")
        modes_data[name] = {"mode": name, "seconds": seconds, "tokens_per_s": sum(limits) / seconds,
                            "breakdown": b, **counters}
        report.row("graphs", modes_data[name])
    padded, plain = results["eager, padded buckets"], results["eager, unpadded"]
    agree_plain = sum(a == b for a, b in zip(padded, plain))
    report.line("")
    report.line(f"padded vs unpadded eager: {agree_plain}/{n} token-identical"
                + ("" if on_gpu else " (fp32 on a CPU: must be all)"))
    ok = agree_plain == n if not on_gpu else True
    if on_gpu:
        replayed = results["CUDA graphs"]
        agree = sum(a == b for a, b in zip(replayed, padded))
        report.line(f"graph replay vs eager padded (the same kernels on the same buffers): {agree}/{n} "
                    f"token-identical")
        speedup = modes_data["eager, unpadded"]["seconds"] / modes_data["CUDA graphs"]["seconds"]
        host = modes_data["CUDA graphs"]["breakdown"].get("host_fraction")
        verdict = "not measured" if host is None else f"{host:.0%}, {'met' if host < 0.2 else 'missed'}"
        report.line(f"speed-up of graphs over eager unpadded: {speedup:.2f}x; target: host share of a "
                    f"decode step < 20% with graphs: {verdict} (a performance target: the part passes on "
                    f"exactness alone)")
        report.put("graph_replay_identical", agree)
        ok = agree == n
    report.finish(ok)


PARTS = {"graphs": graphs}
