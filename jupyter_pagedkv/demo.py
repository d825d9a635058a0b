"""The main job (`make demo`): 8 chat prompts of different lengths at once on the embedded model,
their answers, then the block-pool summary."""
from __future__ import annotations

import argparse
import time

from . import Engine, SamplingParams

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a cat sleeping in the sun.",
    "Give me three tips for writing clear Python code, one line each.",
    "A train leaves at 3 pm and travels for 2 hours at 60 km/h. How far does it go, and when does "
    "it arrive? Explain step by step.",
    "I am planning a small vegetable garden on a sunny balcony. Which five vegetables grow well in "
    "pots, how much sun does each need, and what is one common mistake beginners make with each?",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF folder or id (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model)
    print(f"loaded {engine.name} in {time.perf_counter() - t0:.1f} s: {engine!r}, "
          f"{engine.kv_cache.nbytes / 2**20:.0f} MiB of KV ({engine.spec.bytes_per_token} bytes/token)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t1 = time.perf_counter()
    outputs = engine.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    elapsed = time.perf_counter() - t1
    generated = sum(len(o.token_ids) for o in outputs)
    for q, o in zip(QUESTIONS, outputs):
        print(f"\n### {q}\n{o.text.strip()}")
        print(f"   [{len(o.prompt_token_ids)} prompt tokens, {o.num_cached_tokens} cached, "
              f"{len(o.token_ids)} generated, finish: {o.finish_reason}, TTFT {o.metrics.ttft * 1e3:.0f} ms]")
    stats = engine.stats()
    print("\n== block pool after the run ==")
    print(stats.summary())
    print(f"run: {generated} tokens in {elapsed:.1f} s = {generated / elapsed:.1f} tokens/s "
          f"({len(QUESTIONS)} requests at once)")
    engine.check_invariants()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
