"""`python -m jupyter_pagedkv.bench dtypes`: the embedded model in fp32 against bf16 on this CPU,
the measurement behind `dtype="auto"` (worker/loader.choose_dtype: bf16 where the CPU computes it
natively). The same seeded chat requests run in both dtypes, alternating round after round; the
table prints every round's ratio, the median and the CPU's vector extensions.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..gpucheck.report import cpu_isa
from .throughput import run_ours


def main(argv: list[str] | None = None) -> int:
    from ..sim.workload import chat_requests
    from ..worker.loader import load_model, native_bf16

    parser = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench dtypes", description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    models = {name: load_model(None, dtype, torch.device("cpu"))
              for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    tokenizer = models["fp32"].tokenizer
    reqs = chat_requests(args.requests)
    prompts = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in reqs]
    limits = [r.max_tokens for r in reqs]
    run_ours(models["bf16"].model, tokenizer, prompts[:2], [4, 4], [])      # warm-up, both dtypes
    run_ours(models["fp32"].model, tokenizer, prompts[:2], [4, 4], [])
    rates: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(args.rounds):
        for name, loaded in models.items():
            t0 = time.perf_counter()
            outs = run_ours(loaded.model, tokenizer, prompts, limits, [])
            rates[name].append(sum(map(len, outs)) / (time.perf_counter() - t0))
    print(f"CPU: {cpu_isa()}; native bf16: {native_bf16() or 'none'}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.requests} chat requests, greedy")
    print("| dtype | tokens/s per round | median |\n|---|---|---:|")
    for name, r in rates.items():
        print(f"| {name} | {', '.join(f'{x:.1f}' for x in r)} | {statistics.median(r):.1f} |")
    ratios = [b / f for b, f in zip(rates["bf16"], rates["fp32"])]
    print(f"bf16 / fp32 per round: {', '.join(f'{x:.2f}x' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    return 0
