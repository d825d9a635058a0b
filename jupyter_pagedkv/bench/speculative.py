"""`python -m jupyter_pagedkv.bench speculative`: tokens/s with and without n-gram speculation.

Two workloads on the embedded SmolLM2-135M-Instruct (fp32, CPU), greedy, one request at a time
(the interactive notebook case, where decoding is bound by reading the weights):
- copy-heavy: edit a given passage (fix its typos, change a name, rewrite it in the present
  tense) -- most of the answer is the passage again, which prompt lookup can draft;
- open chat: the chat benchmark's questions, answers the prompt does not contain.

One engine serves both modes (each request says `speculative="ngram"` or False), so weights,
cache and allocator are shared; the prefix cache is cleared before every request so neither mode
reuses the other's prompt KV. Modes alternate inside every round (the order flips each round)
and the table reports medians of per-round tokens/s. Greedy speculation is exact, so both modes
generate the same tokens; the benchmark checks that and says how many outputs matched.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..sim.workload import chat_requests

PASSAGE = (
    "The lighthouse at the end of the harbour was built in 1874 by a company of stone masons "
    "from the north. For almost a century its keeper climbed the one hundred and twelve steps "
    "every evening to light the lamp, and every morning to put it out again. Ships coming home "
    "in the fog listened for its bell, which rang twice a minute. In 1962 the lamp was replaced "
    "by an electric light, and the last keeper, Thomas Wren, moved into a small house by the "
    "quay, where he lived until his death. Today the tower is a museum, and visitors can still "
    "climb the steps to see the old lens, which weighs more than two tons."
)
TYPOS = (PASSAGE.replace("harbour", "harbuor").replace("century", "centruy")
         .replace("evening", "evenning").replace("visitors", "vistors"))
COPY_TASKS = [
    f"Correct the spelling mistakes in this passage and return the whole corrected passage:\n\n{TYPOS}",
    f"Repeat this passage exactly, but change the keeper's name from Thomas Wren to Samuel Hart:\n\n{PASSAGE}",
    f"Copy the following passage word for word:\n\n{PASSAGE}",
]
TARGETS = {"copy-heavy": (">=", 1.5), "open chat": (">=", 0.95)}


def run_mode(engine, prompts: list[list[int]], max_tokens: int, speculative) -> tuple[float, int, list[list[int]]]:
    """Generate the prompts one at a time; returns (seconds, tokens generated, outputs)."""
    from ..core.sampling_params import SamplingParams

    outs, tokens, seconds = [], 0, 0.0
    for p in prompts:
        engine.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=speculative)
        t0 = time.perf_counter()
        out = engine.generate(p, params)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        outs.append(out.token_ids)
    return seconds, tokens, outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians are reported)")
    ap.add_argument("--copy-tokens", type=int, default=96, help="max_tokens of each copy-heavy request")
    ap.add_argument("--chat-requests", type=int, default=3)
    ap.add_argument("--chat-tokens", type=int, default=48, help="max_tokens of each open-chat request")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice; 1 is steadier on a machine shared with other jobs)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from ..engine.engine import Engine

    engine = Engine.from_pretrained(None, device="cpu", dtype="float32", kv_cache_memory="256MiB",
                                    num_speculative_tokens=args.k)
    template = engine.apply_chat_template
    workloads = {
        "copy-heavy": ([template([{"role": "user", "content": t}]) for t in COPY_TASKS], args.copy_tokens),
        "open chat": ([template(r.messages) for r in chat_requests(args.chat_requests)], args.chat_tokens),
    }
    print(f"model: {engine.name}, fp32, CPU; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"one request at a time, greedy, k={args.k}; {args.rounds} alternating rounds, medians")
    for name, (prompts, mt) in workloads.items():
        print(f"  {name}: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
              f"tokens, max_tokens {mt}")
    modes = {"plain": False, "ngram": "ngram"}
    with torch.inference_mode():
        engine.generate(workloads["open chat"][0][0], None)   # warm-up: lazy inits, allocator
        rates = {(w, m): [] for w in workloads for m in modes}
        outputs: dict[tuple[str, str], list[list[int]]] = {}
        spec_counts: dict[str, list[int]] = {w: [0, 0] for w in workloads}
        for r in range(args.rounds):
            for w, (prompts, mt) in workloads.items():
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for m in order:
                    before = engine.stats()
                    sec, tok, outs = run_mode(engine, prompts, mt, modes[m])
                    after = engine.stats()
                    if m == "ngram":
                        spec_counts[w][0] += after.spec_proposed_tokens - before.spec_proposed_tokens
                        spec_counts[w][1] += after.spec_accepted_tokens - before.spec_accepted_tokens
                    rates[(w, m)].append(tok / sec)
                    outputs[(w, m)] = outs
                    print(f"  round {r + 1}: {w:10s} {m:6s} {tok:4d} tokens {sec:6.1f} s "
                          f"{tok / sec:6.1f} tokens/s", flush=True)
    engine.check_invariants()
    print()
    print("| workload | plain tokens/s | ngram tokens/s | speed-up | paired rounds (median) | target "
          "| acceptance | identical outputs |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    results, ok = {}, True
    for w in workloads:
        plain = statistics.median(rates[(w, "plain")])
        spec = statistics.median(rates[(w, "ngram")])
        ratio = spec / plain
        # Each round runs both modes back to back, so a round's ratio cancels slow drifts in load.
        paired = [b / a for a, b in zip(rates[(w, "plain")], rates[(w, "ngram")])]
        op, bound = TARGETS[w]
        met = ratio >= bound and statistics.median(paired) >= bound
        ok &= met
        same = sum(a == b for a, b in zip(outputs[(w, "plain")], outputs[(w, "ngram")]))
        proposed, accepted = spec_counts[w]
        acc = accepted / proposed if proposed else 0.0
        print(f"| {w} | {plain:.1f} | {spec:.1f} | **{ratio:.2f}x** | "
              f"{' / '.join(f'{x:.2f}' for x in paired)} ({statistics.median(paired):.2f}x) | {op} {bound}x: "
              f"{'met' if met else 'NOT met'} | {acc:.0%} of {proposed} drafts | "
              f"{same}/{len(outputs[(w, 'plain')])} |")
        results[w] = dict(plain_tokens_per_s=plain, ngram_tokens_per_s=spec, ratio=ratio, target=bound,
                          paired_ratios=paired,
                          met=met, proposed=proposed, accepted=accepted, identical=same,
                          rounds_plain=rates[(w, "plain")], rounds_ngram=rates[(w, "ngram")])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    engine.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    import sys
    raise SystemExit(main(sys.argv[1:]))
