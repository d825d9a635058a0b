"""`python -m jupyter_pagedkv.bench kvquant`: what a quantized KV cache costs in quality, measured
on the embedded model through the engine itself (not assumed).

The held-out text is `kvquant_text.txt`, shipped beside this module: the prose paragraphs of this
project's docs/design.md (written after the model was trained, so it has not seen them), about
4,500 tokens. For each KV dtype ("auto" = the model's, then fp8_e4m3 and int8) the engine
teacher-forces windows of the text through its prefill with `prompt_logprobs`, in chunks of
`--chunk` tokens, so every chunk after the first reads its prefix back from the (quantized) cache:

- perplexity of the text, and its change against the model dtype's;
- top-1 agreement: the share of positions where the most likely next token is the model dtype's;
- greedy agreement: `--continuations` greedy continuations of 128 tokens from points of the text,
  the share of positions equal to the model dtype's, and the tokens before the first difference.

A second table repeats the top-1 figure with the windows shifted (`--shifts`, tokens into the text:
other cut points, other contexts for every position) and reports each KV dtype's minimum over the
shifts and its agreement over all of them: a figure that holds on one cut of the text only is noise.

A last row calibrates those figures: the model dtype again, with prefill chunks of a different
size (`--chunk` * 3 // 4). Nothing is quantized there; only the order of roundings changes (other
GEMM and attention shapes), so its agreement is the model dtype's own rounding noise: ~100% in
fp32, less in bf16. A reference for the size of a disagreement, not a ceiling: the quantized runs
keep the baseline's chunk boundaries, so they can agree better than it.

Acceptance (issue 37): fp8 perplexity within 1% of the model dtype's, top-1 agreement >= 97%.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..gpucheck.report import cpu_isa
from .cli import at_least

TEXT = Path(__file__).with_name("kvquant_text.txt")
KINDS = ("auto", "fp8_e4m3", "int8")


@dataclass
class Teacher:
    """One KV dtype's teacher-forced pass: the true token's log-probability and the top-1 token
    at every scored position."""

    logprobs: list[float]
    top1: list[int]

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def windows_of(ids: list[int], shift: int, tokens: int, window: int) -> list[list[int]]:
    """`tokens` tokens of the text from `shift` on, cut into windows of `window` (one-token tails dropped)."""
    text = ids[shift:shift + tokens]
    return [text[i:i + window] for i in range(0, len(text) - 1, window) if len(text[i:i + window]) > 1]


def top1_agreement(ours: Teacher, base: Teacher) -> tuple[int, int]:
    """(positions whose top-1 token is the baseline's, positions scored)."""
    return sum(a == b for a, b in zip(ours.top1, base.top1)), len(base.top1)


def teacher_forced(engine, windows: list[list[int]]) -> Teacher:
    """Every window as one prompt (max_tokens=1) with prompt_logprobs=1."""
    from ..core.sampling_params import SamplingParams

    outs = engine.generate(windows, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    lps, top1 = [], []
    for window, out in zip(windows, outs):
        for token, position in zip(window[1:], out.prompt_logprobs[1:]):
            lps.append(position[token].logprob)
            top1.append(next(t for t, lp in position.items() if lp.rank == 1))
    return Teacher(lps, top1)


def greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from ..core.sampling_params import SamplingParams

    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                         ignore_eos=True))]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(share of positions equal, mean tokens before the first difference)."""
    same = sum(a == b for o, r in zip(ours, ref) for a, b in zip(o, r))
    total = sum(len(r) for r in ref)
    first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(ours, ref)]
    return same / total, sum(first) / len(first)


def main(argv: list[str] | None = None) -> int:
    from ..engine.engine import Engine
    from ..worker.loader import load_model

    parser = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench kvquant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the model's dtype")
    parser.add_argument("--tokens", type=at_least(2), default=4096, help="text tokens scored (at most the file's)")
    parser.add_argument("--window", type=at_least(2), default=512, help="tokens per teacher-forced window")
    parser.add_argument("--chunk", type=at_least(2), default=128,
                        help="prefill chunk (max_num_batched_tokens); the last row's chunks are 3/4 of it")
    parser.add_argument("--continuations", type=at_least(1), default=4, help="greedy continuations (of --new-tokens)")
    parser.add_argument("--new-tokens", type=at_least(1), default=128, help="tokens per greedy continuation")
    parser.add_argument("--shifts", type=at_least(1), nargs="*", default=[128, 256, 384],
                        help="the top-1 table's other window starts, in tokens into the text (besides 0)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    loaded = load_model(None, getattr(torch, args.dtype), torch.device("cpu"))
    all_ids = loaded.tokenizer(TEXT.read_text())["input_ids"]
    ids = all_ids[:args.tokens]
    shifts = [0, *args.shifts]
    if max(shifts) >= len(all_ids) - 1:
        parser.error(f"--shifts: the text has {len(all_ids):,} tokens, so a shift must be below {len(all_ids) - 1:,}")
    windows = {shift: windows_of(all_ids, shift, args.tokens, args.window) for shift in shifts}
    starts = [len(ids) * (k + 1) // (args.continuations + 1) for k in range(args.continuations)]
    prompts = [ids[max(0, s - 64):s] for s in starts]
    teach, cont, info = {}, {}, {}
    floor_chunk = args.chunk * 3 // 4
    runs = [(kind, kind, args.chunk) for kind in KINDS] + [("floor", "auto", floor_chunk)]
    for name, kind, chunk in runs:
        engine = Engine(loaded.model, loaded.tokenizer, kv_cache_dtype=kind, max_num_batched_tokens=chunk,
                        kv_cache_memory="256MiB")
        info[name] = engine.info()
        teach[name] = {shift: teacher_forced(engine, windows[shift]) for shift in shifts}
        cont[name] = greedy(engine, prompts, args.new_tokens)
        engine.check_invariants()
        engine.shutdown()
    base = teach["auto"][0]
    print(f"CPU: {cpu_isa()}; torch {torch.__version__}, {torch.get_num_threads()} threads; embedded model in "
          f"{args.dtype}; text {TEXT.name}: {sum(len(w) - 1 for w in windows[0]):,} scored positions in "
          f"{len(windows[0])} windows of <= {args.window}, prefill chunks of {args.chunk}; "
          f"{args.continuations} greedy continuations of {args.new_tokens}")
    print("| KV dtype | bytes/token | blocks in 256 MiB | perplexity | vs model dtype | top-1 agreement "
          "| greedy agreement | tokens before first difference |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    labels = {name: info[name].kv_dtype if name != "floor" else
              f"{info[name].kv_dtype}, chunks of {chunk} (rounding order alone)" for name, _, chunk in runs}
    for name, _, chunk in runs:
        t, i = teach[name][0], info[name]
        same, n = top1_agreement(t, base)
        share, first = agreement(cont[name], cont["auto"])
        print(f"| {labels[name]} | {i.bytes_per_block // i.block_size:,} | {i.num_blocks:,} | {t.perplexity:.4f} | "
              f"{t.perplexity / base.perplexity - 1:+.2%} | {same / n:.2%} | {share:.2%} | {first:.1f} |")
    scored = sum(len(w) - 1 for shift in shifts for w in windows[shift])
    print(f"\nTop-1 agreement with the windows starting {', '.join(map(str, shifts))} tokens into the text "
          f"({scored:,} positions in all):\n")
    print(f"| KV dtype | {' | '.join(f'from {shift}' for shift in shifts)} | minimum | all |\n"
          f"|---|{'---:|' * (len(shifts) + 2)}")
    for name, _, _ in runs[1:]:
        counts = [top1_agreement(teach[name][shift], teach["auto"][shift]) for shift in shifts]
        shares = [same / n for same, n in counts]
        pooled = sum(same for same, _ in counts) / sum(n for _, n in counts)
        print(f"| {labels[name]} | {' | '.join(f'{x:.2%}' for x in shares)} | {min(shares):.2%} | {pooled:.2%} |")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0
