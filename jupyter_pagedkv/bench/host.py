"""`python -m jupyter_pagedkv.bench host`: the host's part of a decode step at large batch.

Why: with CUDA graphs a GPU replays a whole decode step's forward in one call, and what is left
around it is Python on the host: scheduling, preparing the step's inputs, sampling and appending
tokens. On the first H200 run that was 49% of a graphed step at 210 requests (docs/benchmarks.md).
Those phases do not depend on the accelerator, so they are measured here, on the CPU, with a
2-layer model of hidden size 64 whose forward costs next to nothing: each phase's median over the
decode steps with at least half the requests running, and per request in the batch.

Each row is one engine (torch attention, padded decode buckets as under CUDA graphs) running
`--requests` random prompts (`--prompt-len`, default 32-64 tokens, seeded) to 48-96 greedy
tokens, EOS ignored, twice: the second run is timed. Long prompts show what grows with context.
`--tokenizer` adds the embedded model's tokenizer (49,152 tokens), so detokenising is paid as in
real use; without it the vocabulary is 512, so the sampling rows' arithmetic stays small.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from ..gpucheck.report import cpu_isa
from ..worker.step_timing import summarize

PHASES = ("schedule_s", "prepare_s", "launch_s", "sample_s", "total_s")


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256], help="concurrent requests per row")
    ap.add_argument("--tokenizer", action="store_true", help="with the embedded model's tokenizer")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 64], metavar=("LO", "HI"),
                    help="prompt lengths, drawn uniformly (default 32 64)")
    ap.add_argument("--smoke", action="store_true", help="8 requests of 8 tokens: checks the bench runs")
    return ap.parse_args(argv)


def run_row(n: int, tokenizer, vocab: int, smoke: bool, prompt_len: tuple[int, int] = (32, 64)) -> dict:
    """One engine, `n` requests: phase medians (seconds) over its second run's decode steps."""
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine
    from ..testing.models import tiny_model

    model = tiny_model("llama", vocab=vocab)
    model.config.max_position_embeddings = max(512, prompt_len[1] + 128)   # rotary is computed per position
    rng = random.Random(n)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    limits = [8] * n if smoke else [rng.randint(48, 96) for _ in range(n)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in limits]
    # KV for every request at once: 512 bytes a token (2 layers x K, V x 2 heads x 16 x fp32), doubled.
    kv_mib = max(256, n * (prompt_len[1] + 128) * 1024 // 2**20 + 64)
    engine = Engine(model, tokenizer, attention_backend="torch", max_num_seqs=n, max_num_batched_tokens=8192,
                    pack_weights=False, pad_decode=True, kv_cache_memory=f"{kv_mib}MiB")
    try:
        engine.generate(prompts, params)               # warm: buckets, allocator, caches
        engine.step_timings = []
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        engine.check_invariants()
        summary = summarize(engine.step_timings, min_decode=max(1, n // 2))
    finally:
        engine.shutdown()
    return {"requests": n, "seconds": seconds, **summary}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv or [])
    tokenizer, vocab = None, 512
    if args.tokenizer:
        from transformers import AutoTokenizer

        from ..worker.loader import embedded_model_dir
        tokenizer, vocab = AutoTokenizer.from_pretrained(embedded_model_dir()), 49152
    requests = [8] if args.smoke else args.requests
    lo, hi = args.prompt_len
    print(f"CPU: {cpu_isa()}; torch {torch.__version__}, {torch.get_num_threads()} threads; tiny llama (2 layers, "
          f"hidden 64), vocabulary {vocab}, {'the embedded tokenizer' if tokenizer else 'no tokenizer'}; "
          f"prompts of {lo}-{hi} tokens; torch attention, padded decode buckets")
    print("decode steps with at least half the requests running, medians in ms (per request in us)")
    print()
    print("| requests | steps | schedule | prepare | forward | sample | step | host, per request |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in requests:
        row = run_row(n, tokenizer, vocab, args.smoke, (lo, hi))
        if not row.get("steps"):
            print(f"| {n} | 0 | no decode step with {max(1, n // 2)} requests running | | | | | |")
            continue
        ms = {k: row[k] * 1e3 for k in PHASES}
        host = row["schedule_s"] + row["prepare_s"] + row["sample_s"]
        print(f"| {n} | {row['steps']} | {ms['schedule_s']:.2f} | {ms['prepare_s']:.2f} | {ms['launch_s']:.2f} | "
              f"{ms['sample_s']:.2f} | {ms['total_s']:.2f} | {host / row['median_batch'] * 1e6:.1f} |")
    return 0
