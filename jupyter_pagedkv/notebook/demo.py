"""The main job (`make demo`): 8 chat prompts of different lengths at once on the embedded model,
their answers, then the block-pool summary. An answer that loops (greedy decoding of a 135M model
can) gets one line beside it saying whether transformers' `generate` gives the same tokens."""
from __future__ import annotations

import argparse
import time

from ..core.sampling_params import SamplingParams
from ..engine.engine import Engine
from .loops import check_against_transformers, find_loop

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in two sentences why the sky is blue.",
    "What is photosynthesis? Answer in one sentence.",
    "Give me three tips for a good night's sleep.",
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
    info = engine.info()
    print(f"loaded {engine.name} in {time.perf_counter() - t0:.1f} s: {engine!r}, "
          f"{info.kv_bytes / 2**20:.0f} MiB of KV ({info.bytes_per_block // info.block_size} bytes/token)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t1 = time.perf_counter()
    ids = [engine.add_request(engine.apply_chat_template([{"role": "user", "content": q}]), params)
           for q in QUESTIONS]
    done, peak = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        stats = engine.stats()
        if peak is None or stats.num_used > peak.num_used:
            peak = stats   # the fullest moment of the pool, to show paging's waste
    elapsed = time.perf_counter() - t1
    outputs = [done[i] for i in ids]
    generated = sum(len(o.token_ids) for o in outputs)
    oracle = None
    for q, o in zip(QUESTIONS, outputs):
        print(f"\n### {q}\n{o.text.strip()}")
        print(f"   [{len(o.prompt_token_ids)} prompt tokens, {o.num_cached_tokens} cached, "
              f"{len(o.token_ids)} generated, finish: {o.finish_reason}, TTFT {o.metrics.ttft * 1e3:.0f} ms]")
        loop = find_loop(o.token_ids)
        if loop is not None:
            if oracle is None:    # a second, plain transformers copy of the model: an independent check
                from ..worker.loader import load_model
                oracle = load_model(args.model, engine.dtype, engine.device).model
            check = check_against_transformers(oracle, list(o.prompt_token_ids), list(o.token_ids),
                                               params.max_tokens)
            print(check.line(loop))
    live = peak.num_running + peak.num_waiting
    print(f"\n== block pool at its fullest ({live} live sequences) ==")
    print(f"{peak.num_used} blocks used, {peak.tokens_stored} tokens stored in "
          f"{peak.slots_allocated} slots: waste {peak.internal_waste} slots = "
          f"{peak.internal_waste / max(live, 1):.1f} per sequence (< block_size {engine.block_size})")
    reserved = sum(len(o.prompt_token_ids) + params.max_tokens for o in outputs)
    filled = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs)
    print(f"a contiguous reservation of prompt + max_tokens per request would hold {reserved} slots "
          f"for these requests; they ever filled {filled} ({filled / reserved:.0%})")
    print("\n== block pool after the run ==")
    print(engine.stats().summary())
    print(f"run: {generated} tokens in {elapsed:.1f} s = {generated / elapsed:.1f} tokens/s "
          f"({len(QUESTIONS)} requests at once)")
    engine.check_invariants()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
