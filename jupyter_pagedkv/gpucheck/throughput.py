"""End-to-end throughput parts of the GPU check: our engine against transformers' continuous
batching and padded `generate`, the same requests on the same device, bf16, random weights,
EOS ignored (speed does not depend on the weights' values).

Also measured here, from our own run: where a step's time goes (host scheduling, input
preparation, kernel launches, the forward's device time by CUDA events, sampling), and whether
the KV cache sized from free memory survives full load without running out of memory.
"""
from __future__ import annotations

import logging
import random
import time

import torch

from ..worker.step_timing import summarize

from .report import Report, device
from ..testing.peers import hf_continuous_session, hf_padded
from ..testing.models import shaped_model

logger = logging.getLogger(__name__)

SYSTEMS = ("jupyter-pagedkv, eager", "HF continuous batching", "HF generate, one padded batch")
# Our engine with its decode steps padded to buckets: replayed as CUDA graphs on a GPU; on a CPU
# (the rehearsal) run eagerly, which exercises the same code path.
GRAPHS = "jupyter-pagedkv, CUDA graphs"


def workload(n: int, vocab: int, smoke: bool, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """`n` requests of mixed prompt and output lengths (seeded): chat-like prompts and answers."""
    rng = random.Random(seed)
    p_lo, p_hi, o_lo, o_hi = (4, 24, 2, 8) if smoke else (32, 512, 32, 256)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(p_lo, p_hi))] for _ in range(n)]
    return prompts, [rng.randint(o_lo, o_hi) for _ in range(n)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_ours(model, prompts, limits, *, backend: str, budget_tokens: int, timings: list | None,
             **options) -> tuple[list, dict]:
    """Our engine with its KV cache sized from free memory (the default on CUDA); CUDA graphs,
    when asked for, are captured before the clock starts. Returns the outputs and facts, among
    them the seconds `generate` took."""
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    engine = Engine(model, attention_backend=backend, max_num_seqs=max(len(prompts), 1),
                    max_num_batched_tokens=budget_tokens, pack_weights=False,
                    **({} if torch.cuda.is_available() else {"kv_cache_memory": "256MiB"}), **options)
    try:
        captured = engine.warm_up()
        engine.step_timings = timings
        _sync()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                         for m in limits])
        _sync()
        seconds = time.perf_counter() - t0
        engine.check_invariants()
        info, stats = engine.info(), engine.stats()
        facts = {"seconds": seconds, "num_blocks": info.num_blocks, "block_size": info.block_size,
                 "kv_gib": round(info.kv_bytes / 2**30, 2),
                 "max_running": max((t.num_seqs for t in timings), default=None) if timings else None,
                 "preemptions": stats.num_preemptions, "graphs_captured": captured,
                 "graph_replays": stats.num_graph_replays}
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            facts.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                         device_total_gib=round(total / 2**30, 2), free_at_end_gib=round(free / 2**30, 2))
    finally:
        engine.shutdown()
        _empty()
    return [o.token_ids for o in outs], facts


def run_hf_continuous(model, prompts, limits, warm_prompts, warm_limits) -> tuple[list[list[int]], float]:
    """transformers' continuous batching timed in steady state, like ours: its manager started and
    its own warm-up run done before the clock starts. Returns the outputs and the timed seconds."""
    need = sum(-(-(len(p) + m) // 16) for p, m in zip(prompts, limits))
    with hf_continuous_session(model, max(limits + warm_limits), num_blocks=need + 64,
                               max_batch_tokens=2048 if torch.cuda.is_available() else 512,
                               timeout_s=300) as generate:
        generate(warm_prompts, warm_limits)
        _sync()
        t0 = time.perf_counter()
        out = generate(prompts, limits)
        _sync()
        seconds = time.perf_counter() - t0
    _empty()
    return out, seconds


def run_hf_padded(model, prompts, limits) -> list[list[int]]:
    """Static batching: every request in one left-padded batch until the longest is done."""
    out = hf_padded(model, prompts, limits)
    _empty()
    return out


def _empty() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def throughput(report: Report, smoke: bool, shape: str) -> None:
    dev = device()
    on_gpu = dev.type == "cuda"
    backend = "triton"          # the engine's GPU path; on a CPU rehearsal, Triton's interpreter
    layers = 1 if smoke else None
    model = shaped_model(shape, torch.bfloat16, dev, num_layers=layers)
    vocab = model.config.vocab_size
    concurrency = (4, 8) if smoke else (64, 256)
    budget = 8192 if on_gpu else 512
    # Ours twice: eager, and with decode steps replayed as CUDA graphs (on a CPU, padded eagerly:
    # the same code path, no graphs). Both named explicitly, whatever the engine's default.
    ours = {SYSTEMS[0]: {"cuda_graphs": False},
            GRAPHS: {"cuda_graphs": True} if on_gpu else {"cuda_graphs": False, "pad_decode": True}}
    systems = [SYSTEMS[0], GRAPHS, *SYSTEMS[1:]]
    report.line(f"{shape} shape{f', {layers} layer' if layers else ''}, random weights, bf16, greedy, EOS "
                f"ignored; {dev.type}; attention backend {backend}; token budget per step {budget}"
                + ("" if on_gpu else f"; '{GRAPHS}' runs padded eagerly here (no CUDA)"))
    report.line("")
    report.line("| requests | system | tokens | seconds | tokens/s | ours / system |")
    report.line("|---:|---|---:|---:|---:|---:|")
    ok = True
    breakdowns, kv = {}, {}
    with torch.inference_mode():
        # Warm-up: compiles kernels and fills caches on a small run of every system.
        wp, wl = workload(2, vocab, True, seed=99)
        for options in ours.values():
            run_ours(model, wp, wl, backend=backend, budget_tokens=budget, timings=None, **options)
        run_hf_continuous(model, wp, wl, wp, wl)
        run_hf_padded(model, wp, wl)
        for n in concurrency:
            prompts, limits = workload(n, vocab, smoke, seed=n)
            tokens = sum(limits)
            outputs, seconds = {}, {}
            for name in systems:
                _sync()
                t0 = time.perf_counter()
                try:
                    if name in ours:
                        timings: list = []
                        outputs[name], facts = run_ours(model, prompts, limits, backend=backend,
                                                        budget_tokens=budget, timings=timings, **ours[name])
                        kv[f"{n} {name}"] = facts
                        breakdowns[f"{n} {name}"] = summarize(timings, min_decode=max(1, n // 2))
                    elif name == SYSTEMS[1]:
                        outputs[name], seconds[name] = run_hf_continuous(model, prompts, limits, wp, wl)
                    else:
                        outputs[name] = run_hf_padded(model, prompts, limits)
                except Exception as err:   # a peer failing is a finding; ours failing fails the part
                    logger.warning("%s at %d requests failed", name, n, exc_info=True)
                    report.line(f"| {n} | {name} | failed: {type(err).__name__}: {str(err)[:200]} | | | |")
                    ok &= name not in ours
                    _empty()
                    continue
                _sync()
                if name in ours:
                    seconds[name] = facts["seconds"]
                elif name != SYSTEMS[1]:
                    seconds[name] = time.perf_counter() - t0
                produced = sum(len(o) for o in outputs[name])
                ok &= produced == tokens or name not in ours
                ours_s = seconds.get(SYSTEMS[0])
                ratio = f"{seconds[name] / ours_s:.2f}x" if ours_s else "-"
                report.row("throughput", {"shape": shape, "requests": n, "system": name, "tokens": produced,
                                          "seconds": seconds[name], "tokens_per_s": produced / seconds[name]})
                report.line(f"| {n} | {name} | {produced} | {seconds[name]:.2f} | "
                            f"{produced / seconds[name]:.0f} | {ratio} |")
            if SYSTEMS[0] in outputs:
                report.put(f"greedy_agreement_{n}", {name: sum(a == b for a, b in zip(outputs[SYSTEMS[0]], outs))
                                                     for name, outs in outputs.items() if name != SYSTEMS[0]})
            report.put("breakdown", breakdowns)
            report.put("kv", kv)
    report.line("")
    report.line("Greedy outputs equal to ours (bf16: reduction order may flip near-ties): " + "; ".join(
        f"{n} requests: " + ", ".join(f"{k} {v}/{n}" for k, v in report.data["facts"].get(f"greedy_agreement_{n}", {}).items())
        for n in concurrency))
    report.line("")
    report.line("Our decode steps (at least half the requests running), median per phase, ms:")
    report.line("")
    report.line("| run | steps | batch | schedule | prepare | launch | device forward | wait | sample | "
                "step | host share | H2D copies |")
    report.line("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, b in breakdowns.items():
        if b.get("steps"):
            ms = lambda k: f"{b[k] * 1e3:.2f}" if b.get(k) is not None else "-"
            share = f"{b['host_fraction']:.0%}" if "host_fraction" in b else "-"
            copies = f"{b['h2d_copies']:g}" if "h2d_copies" in b else "-"
            report.line(f"| {key} | {b['steps']} | {b['median_batch']:.0f} | {ms('schedule_s')} | "
                        f"{ms('prepare_s')} | {ms('launch_s')} | {ms('device_s')} | {ms('wait_s')} | "
                        f"{ms('sample_s')} | {ms('total_s')} | {share} | {copies} |")
    report.line("")
    for key, facts in kv.items():
        report.line(f"KV, {key}: {facts}")
    report.finish(ok)


PARTS = {"throughput_small": lambda r, s: throughput(r, s, "smollm2-135m"),
         "throughput_large": lambda r, s: throughput(r, s, "llama-3-8b")}
