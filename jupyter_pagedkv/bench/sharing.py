"""`python -m jupyter_pagedkv.bench sharing`: KV blocks saved by sharing, and a shared system prompt.

Part 1 runs parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) on two length
profiles and records, after every engine step, the physical blocks in use (`num_used`: shared
blocks counted once) and the blocks the same sequences would hold with sharing disabled, each
holding a private copy of its whole history (`num_block_refs` = sum of ref counts = sum over
sequences of ceil(len / block_size), by invariant 1). Saving = 1 - sum(used) / sum(private) over
all steps, the PagedAttention paper's definition (blocks saved by sharing / blocks without
sharing). Prefix caching is off, so only sharing inside a request is measured.

Part 2 sends 16 requests that share a 1,000-token system prompt: blocks held vs 16 private
copies, and the TTFT of one request with that prefix cached (warm) vs not (cold), alternating.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as "
    "his father had taught him. Below, the harbour filled with returning boats, their hulls heavy "
    "with mackerel and their crews arguing about the weather. The lamp needed oil, the lens needed "
    "polishing, and the logbook needed a line about the wind, which had turned westerly after noon. "
    "In winter the storms came without warning, and the keeper would sit by the great light all "
    "night, listening to the sea throw itself against the rocks. Ships passed far out, their own "
    "lights small and steady, and he liked to imagine where they were going: grain to the north, "
    "timber to the south, passengers to cities he had only seen on maps pinned to the wall. "
)
QUESTIONS = ["What did the keeper count?", "Which way did the wind turn?", "What filled the harbour?",
             "What needed polishing?", "Where were the ships going?", "When did storms come?",
             "What was pinned to the wall?", "Who taught the keeper?", "What did the crews argue about?",
             "What did the boats carry?", "What did the keeper do at night?", "What did he imagine?",
             "What needed oil?", "What went in the logbook?", "How did the sea sound?",
             "What did the ships' lights look like?"]

# Mean prompt / output lengths of the two datasets in the PagedAttention paper (Fig. 11).
PROFILES = {"alpaca": (19.31, 58.45), "sharegpt": (161.31, 337.99)}
PUBLISHED = {("alpaca", "parallel"): "6.1-9.8%", ("alpaca", "beam"): "37.6-55.2%",
             ("sharegpt", "parallel"): "16.2-30.5%", ("sharegpt", "beam"): "44.3-66.3%"}


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


def lengths(profile: str, n: int, seed: int) -> list[tuple[int, int]]:
    """Seeded (prompt, output) lengths, gamma-distributed (shape 2) around the dataset means."""
    rng = random.Random(seed)
    p_mean, o_mean = PROFILES[profile]
    return [(max(4, round(rng.gammavariate(2.0, p_mean / 2))), max(4, round(rng.gammavariate(2.0, o_mean / 2))))
            for _ in range(n)]


def workload(profile: str, n: int, seed: int, text_ids: list[int], vocab: int) -> Workload:
    """Distinct prompts (different offsets into a real passage, or random ids for a random model)."""
    rng = random.Random(seed + 1)
    prompts, limits = [], []
    for i, (p, o) in enumerate(lengths(profile, n, seed)):
        if text_ids:
            start = (i * 37) % len(text_ids)
            ids = (text_ids * (2 + p // len(text_ids)))[start:start + p]
        else:
            ids = [rng.randrange(3, vocab) for _ in range(p)]
        prompts.append(ids)
        limits.append(o)
    return Workload(prompts, limits)


def tiny_llama(vocab: int = 512, seed: int = 0):
    """A small random Llama (2 layers) with a sharpened output layer, for long profiles on a CPU."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def measure(engine, work: Workload, mode: str, width: int) -> dict:
    """Run the workload to completion; sum physical and private-copy blocks over every step."""
    from ..core.sampling_params import BeamSearchParams, SamplingParams

    for i, (p, m) in enumerate(zip(work.prompts, work.max_tokens)):
        params = (BeamSearchParams(beam_width=width, max_tokens=m, ignore_eos=True) if mode == "beam" else
                  SamplingParams(n=width, max_tokens=m, temperature=1.0, seed=i, ignore_eos=True))
        engine.add_request(p, params)
    used = private = peak_used = peak_private = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.stats()
        used += s.num_used
        private += s.num_block_refs
        peak_used, peak_private = max(peak_used, s.num_used), max(peak_private, s.num_block_refs)
        steps += 1
    engine.check_invariants()
    return {"saving": 1 - used / private if private else 0.0, "peak_used": peak_used,
            "peak_private": peak_private, "steps": steps, "seconds": time.perf_counter() - t0,
            "preemptions": engine.stats().num_preemptions}


def part_memory(args, embedded) -> None:
    from ..engine.engine import Engine

    print("\n== KV blocks in use, sharing on vs every sequence holding private copies ==")
    print("saving = 1 - sum(blocks in use) / sum(blocks with private copies), over all steps; "
          f"block_size {args.block_size}, prefix caching off, EOS ignored (fixed lengths)")
    runs = [(prof, mdl) for prof in args.profiles for mdl in args.models
            if not (prof == "sharegpt" and mdl == "embedded" and not args.long_on_embedded)]
    header = f"{'profile':9s} {'model':9s} {'reqs':>4s} {'mode':9s} {'width':>5s} {'saving':>7s} {'peak used':>9s} " \
             f"{'peak private':>12s} {'steps':>5s} {'s':>6s}  published (vLLM paper, OPT-13B)"
    print(header)
    for profile, model_name in runs:
        if model_name == "embedded":
            model, tok = embedded()
            text_ids, vocab = tok(PASSAGE * 4).input_ids, model.config.vocab_size
        else:
            model, tok, text_ids, vocab = tiny_llama(), None, [], 512
        n = args.embedded_requests if model_name == "embedded" else args.requests
        work = workload(profile, n, args.seed, text_ids, vocab)
        # With EOS ignored, parallel sampling's blocks depend only on the lengths, never on the
        # model's tokens, so the embedded model runs it only when asked (--embedded-parallel).
        modes = ("parallel", "beam") if model_name == "tiny" or args.embedded_parallel else ("beam",)
        for mode in modes:
            for width in (2, 4, 6):
                # Room for every sequence privately at full length: sharing never avoids a preemption.
                need = sum(width * -(-(len(p) + m) // args.block_size)
                           for p, m in zip(work.prompts, work.max_tokens))
                engine = Engine(model, tok, block_size=args.block_size, num_blocks=need + 16,
                                enable_prefix_caching=False, max_num_seqs=256)
                r = measure(engine, work, mode, width)
                print(f"{profile:9s} {model_name:9s} {n:4d} {mode:9s} {width:5d} {r['saving']:7.1%} "
                      f"{r['peak_used']:9d} {r['peak_private']:12d} {r['steps']:5d} {r['seconds']:6.1f}  "
                      f"{PUBLISHED[(profile, mode)]}", flush=True)
                assert r["preemptions"] == 0
                del engine


def system_prompt_ids(tok, target: int) -> tuple[str, int]:
    """A system text of about `target` tokens (the passage repeated, cut at a sentence)."""
    text = ""
    sentences = [s.strip() + "." for s in PASSAGE.split(".") if s.strip()]
    i = 0
    while len(tok(text).input_ids) < target:
        text += " " + sentences[i % len(sentences)]
        i += 1
    return text.strip(), len(tok(text.strip()).input_ids)


def part_system_prompt(args, embedded) -> None:
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine

    model, tok = embedded()
    system, n_sys = system_prompt_ids(tok, args.system_tokens)

    def ask(q: str) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    prompts = [ask(q) for q in QUESTIONS]
    shared = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    print(f"\n== 16 requests sharing a {n_sys}-token system prompt ({shared} shared prompt tokens "
          f"after the chat template; prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens) ==")
    engine = Engine(model, tok, block_size=args.block_size, kv_cache_memory="1GiB")
    bs = args.block_size
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for label, warm in (("warm (prefix cached by an earlier request)", True),
                        ("cold (empty cache, all 16 arrive together)", False)):
        engine.reset_prefix_cache()
        if warm:
            engine.generate([ask("Who wrote this?")], params)
        for p in prompts:
            engine.add_request(p, params)
        peak = (0, 0)
        while engine.has_unfinished_requests():
            engine.step()
            s = engine.stats()
            if s.num_block_refs > peak[1]:
                peak = (s.num_used, s.num_block_refs)
        private = sum(-(-len(p) // bs) for p in prompts)
        print(f"  {label}: at the peak {peak[0]} blocks held vs {peak[1]} as 16 private copies "
              f"(all prompts private: {private}); {1 - peak[0] / peak[1]:.1%} saved; the shared prefix "
              f"is {shared // bs} full blocks")
    # TTFT: one request, its system prompt cached (warm) or not (cold); alternating, medians.
    cold, warm = [], []
    for rep in range(args.reps):
        engine.reset_prefix_cache()
        out = engine.generate([prompts[rep % 16]], SamplingParams(max_tokens=1, temperature=0.0))[0]
        cold.append(out.metrics.ttft)
        out = engine.generate([prompts[(rep + 1) % 16]], SamplingParams(max_tokens=1, temperature=0.0))[0]
        warm.append(out.metrics.ttft)
        print(f"  rep {rep + 1}: TTFT cold {cold[-1] * 1e3:7.1f} ms, warm {warm[-1] * 1e3:7.1f} ms "
              f"({out.num_cached_tokens}/{len(out.prompt_token_ids)} prompt tokens cached)", flush=True)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"  TTFT median: cold {c * 1e3:.1f} ms, warm {w * 1e3:.1f} ms, warm/cold {w / c:.3f} "
          f"(target <= 0.25: {'met' if w / c <= 0.25 else 'NOT met'})")
    engine.check_invariants()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench sharing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="memory,system", help="memory and/or system (comma-separated)")
    ap.add_argument("--profiles", default="alpaca,sharegpt")
    ap.add_argument("--models", default="embedded,tiny",
                    help="embedded (SmolLM2-135M) and/or tiny (a random 2-layer Llama: fast)")
    ap.add_argument("--embedded-parallel", action="store_true",
                    help="also run parallel sampling on the embedded model (same counts as tiny)")
    ap.add_argument("--long-on-embedded", action="store_true",
                    help="also run the sharegpt profile on the embedded model (slow on a CPU)")
    ap.add_argument("--requests", type=int, default=8, help="requests per configuration (tiny model)")
    ap.add_argument("--embedded-requests", type=int, default=2,
                    help="requests per configuration on the embedded model")
    ap.add_argument("--memory-threads", type=int, default=1,
                    help="torch threads for the block counts (they do not depend on speed; on a "
                         "loaded 2-core machine one thread is many times faster for the tiny model)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3, help="TTFT repetitions (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for the TTFT part (default: torch's choice; on a machine "
                         "loaded by other jobs one thread avoids thread thrash)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.profiles = args.profiles.split(",")
    args.models = args.models.split(",")
    cache: dict = {}

    def embedded():
        if "m" not in cache:
            from jupyter_pagedkv.worker.loader import load_model
            loaded = load_model(None, torch.float32, torch.device("cpu"))
            cache["m"] = (loaded.model, loaded.tokenizer)
        return cache["m"]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU fp32")
    parts = args.parts.split(",")
    if "memory" in parts:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.memory_threads)
        print(f"block counts measured with {args.memory_threads} thread(s)")
        part_memory(args, embedded)
        torch.set_num_threads(threads)
    if "system" in parts:
        part_system_prompt(args, embedded)
    return 0


if __name__ == "__main__":
    import sys
    raise SystemExit(main(sys.argv[1:]))
