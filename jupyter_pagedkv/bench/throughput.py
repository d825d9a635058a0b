"""`python -m jupyter_pagedkv.bench throughput`: our engine against peers on one seeded workload,
per dtype, plus long-prompt TTFT, the machine's GEMM peak and where a decode step goes.

All in-process systems run alternately, round after round, on the same weights and prompts; every
round's ratio is printed beside the median. vLLM's CPU build runs in its own venv (`make
bench-peers`) as a subprocess of the same command. Every request generates exactly its max_tokens
(EOS ignored), greedy. dtypes: float32, and bfloat16 where the CPU computes it natively (or as
asked with --dtype); the slow HF peers (one at a time, padded batches) run in float32 only.

JSON (--json PATH), stable keys:
  machine: {cpu, isa, native_bf16, threads, torch, model, date}
  throughput: {dtype: [{system, tokens, round_seconds: [...], seconds (median round), tokens_per_s
      (tokens / seconds), ours_over (median of ours_over_per_round), ours_over_per_round: [ours
      tokens/s over the system's, round i against round i]}, ...]}; the first row is ours
  agreement: {dtype: {system: identical greedy outputs out of the requests}}
  long_prompt: {dtype: {"2048": {ours_s: [...] (TTFT per pair), hf_s: [...] (transformers
      generate(max_new_tokens=1) per pair), ratio_per_round: [...], ratio_median, ours_first_token,
      hf_first_token, same_first_token, cached_prefix_s: [...] (TTFT of 11 new tokens after the
      prompt, over its cached blocks), new_tokens_alone_s: [...] (those 11 tokens as a prompt of
      their own), cached_over_alone_per_round: [...], cached_over_alone_median}}}
  gemm: {dtype: {peak_gflops (packed or stock, the faster, over the model's linear shapes: the
      fastest of 5 passes at each --gemm-rows count), peak_rows (where it was reached),
      flops_per_step, decode_gflops (a batch-32 decode step's GEMM
      FLOPs over its profiled GEMM self time), fraction (decode_gflops / peak_gflops)}}
  step: {dtype: {batch, steps, ms_per_step (unprofiled), profiled_ms_per_step, gemm_ms, gemm_pct,
      attention_ms, attention_pct, kv_ms, kv_pct, other_ms, other_pct, overhead_ms, overhead_pct,
      gemm_s_per_step}}   (ms per step; pct of the profiled step's wall time)
  notes: [lines, e.g. why bf16 was skipped]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from . import throughput_report as report
from ..testing.peers import hf_continuous, hf_padded, hf_single
from ..sim.workload import chat_requests
from ..config import choices_of
from .cli import at_least

REPO = Path(__file__).resolve().parents[2]
PEER_VENV = REPO / ".venv-peers"
OURS = "jupyter-pagedkv"
RECORDING = "jupyter-pagedkv, recording (engine.record)"
SINGLE, PADDED, CONTINUOUS = "HF generate, one at a time", "HF generate, padded batches of 8", "HF continuous batching"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_ours(model, tokenizer, prompts, limits, step_log: list, record: bool = False,
             served: list[float] | None = None, **options) -> list[list[int]]:
    """Our engine, stepped here; `step_log` receives every step's phase timings; `options` are
    EngineConfig's (e.g. kv_cache_dtype); `record`: the whole run under `engine.record()` (in
    memory), to measure what recording costs. A fresh engine each call, so each round starts with
    a cold prefix cache; `served` (if given) receives the seconds from the first request added to
    the last output, the engine's construction left out as vLLM's start-up is (building one took
    ~0.8 s, a quarter of a short workload's round)."""
    import contextlib

    from ..engine.engine import Engine

    engine = Engine(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=2048, **options)
    engine.step_timings = step_log
    with engine.record() if record else contextlib.nullcontext():
        t0 = time.perf_counter()
        outputs = _run_ours(engine, prompts, limits)
        if served is not None:
            served.append(time.perf_counter() - t0)
        return outputs


def _run_ours(engine, prompts, limits) -> list[list[int]]:
    from ..core.sampling_params import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(prompts, limits)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    engine.check_invariants()
    return [done[i] for i in ids]


def run_hf_single(model, prompts, limits) -> list[list[int]]:
    return hf_single(model, prompts, limits, pad_id=2)


def run_hf_padded(model, prompts, limits, batch: int = 8) -> list[list[int]]:
    return hf_padded(model, prompts, limits, batch=batch, pad_id=2)


def run_hf_continuous(model, prompts, limits) -> list[list[int]]:
    return hf_continuous(model, prompts, limits, num_blocks=2048, max_batch_tokens=2048, pad_id=2)


def run_vllm(model_dir: Path, prompts, limits, repeats: int, dtype: str = "float32") -> dict | None:
    if not (PEER_VENV / ".ok").exists():
        return None
    return run_peer_vllm(model_dir, [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, limits)],
                         repeats, dtype, timeout=1800)


def run_peer_vllm(model_dir: Path, payload, repeats: int, dtype: str, timeout: int) -> dict | None:
    """One start of peer_vllm.py in the peer venv on `payload` (its request list); its JSON
    result, or None (the reason on stderr). (`--shapes` keeps one vLLM up instead: vllm_session.py.)"""
    python = PEER_VENV / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        req.write_text(json.dumps(payload))
        cmd = [str(python), str(Path(__file__).with_name("peer_vllm.py")), "--model-dir", str(model_dir),
               "--requests", str(req), "--out", str(out), "--dtype", dtype, "--repeats", str(repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            print(f"vLLM CPU failed (exit {proc.returncode}):\n{proc.stderr[-1500:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=at_least(1), default=32)
    ap.add_argument("--rounds", type=at_least(1), default=2, help="alternating rounds of the in-process systems")
    ap.add_argument("--single-subset", type=int, default=8,
                    help="requests timed for one-at-a-time generate (it is slow; tokens/s is per request)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["single", "padded", "continuous", "vllm", "step"],
                    help="systems to leave out (step: the GEMM peak and the decode-step profile)")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES),
                    help="default: both where the CPU has native bf16, else float32")
    ap.add_argument("--long-prompts", type=int, nargs="*", default=[2048, 8192],
                    help="prompt lengths for the TTFT table (none, or 0, to leave it out)")
    ap.add_argument("--long-rounds", type=int, default=3, help="alternating pairs per long prompt")
    ap.add_argument("--gemm-rows", type=int, nargs="+", default=[512, 2048],
                    help="row counts over which the GEMM peak (the fastest pass) is taken")
    ap.add_argument("--step-batch", type=int, default=32, help="sequences in the profiled decode steps")
    ap.add_argument("--step-steps", type=int, default=10, help="decode steps timed, and as many profiled")
    ap.add_argument("--record", action="store_true",
                    help="also run our engine recording every request (engine.record), alternating with it: "
                         "the ratio line is recording's overhead")
    ap.add_argument("--json", type=Path, help="also write the results here (keys: see above)")
    ap.add_argument("--shapes", type=at_least(0), default=0, metavar="N",
                    help="instead of the tables above: N seeded workload shapes (short/long outputs, shared/"
                         "distinct prefixes, 8-64 requests), ours against vLLM CPU on each, and the minimum "
                         "ratio over them (throughput_shapes.py)")
    ap.add_argument("--shape-seed", type=int, default=0, help="seed of the shapes and their texts")
    ap.add_argument("--weights", choices=["dense", "packed"], default="dense",
                    help="with --shapes: packed adds a second table, ours on the GGUF's packed blocks (fp32)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=choices_of("kv_cache_dtype"),
                    help="with --shapes: not auto adds a second table, ours with this KV cache dtype "
                         "(EngineConfig.kv_cache_dtype)")
    args = ap.parse_args(argv)
    shape_only = [flag for flag, given in (("--shape-seed", args.shape_seed != 0), ("--weights", args.weights != "dense"),
                                           ("--kv-cache-dtype", args.kv_cache_dtype != "auto")) if given]
    if shape_only and not args.shapes:
        ap.error(f"{', '.join(shape_only)} only act with --shapes N")
    args.long_prompts = [n for n in args.long_prompts if n > 0]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shapes:     # bench/__main__.py sends --shapes to throughput_shapes.main
        raise SystemExit("--shapes runs through throughput_shapes.main (python -m jupyter_pagedkv.bench throughput --shapes N)")
    from transformers import AutoTokenizer

    from ..worker.loader import EMBEDDED_NAME, embedded_model_dir

    dtypes, note = report.choose_dtypes(args.dtype)
    model_dir = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reqs = chat_requests(args.requests)
    prompts = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in reqs]
    limits = [r.max_tokens for r in reqs]
    machine = report.machine_info(EMBEDDED_NAME, torch.__version__, torch.get_num_threads())
    print(f"model: {machine['model']}; CPU: {machine['cpu']} ({machine['isa']}; native bf16: "
          f"{machine['native_bf16'] or 'none'}); torch {machine['torch']}, {machine['threads']} threads")
    print(f"workload: {len(prompts)} chat requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, max_tokens 16-128 (seeded), {sum(limits)} tokens to generate; greedy, EOS ignored; "
          f"dtypes {', '.join(dtypes)}; {args.rounds} alternating rounds")
    if note:
        print(note)
    throughput, agreement, long_prompt, gemm, step = {}, {}, {}, {}, {}
    for dtype in dtypes:
        ours_model, peer_model = _load(dtype, model_dir)
        rows, outputs = _throughput(dtype, ours_model, peer_model, tokenizer, prompts, limits, args, model_dir)
        throughput[dtype] = rows
        agreement[dtype] = {n: sum(a == b for a, b in zip(outputs[OURS], o)) for n, o in outputs.items() if n != OURS}
        if args.long_prompts:
            long_prompt[dtype] = _long(ours_model, peer_model, tokenizer, args, dtype)
        if "step" not in args.skip:
            gemm[dtype], step[dtype] = _gemm_and_step(ours_model, tokenizer, args, dtype)
        del ours_model, peer_model
        gc.collect()
    _print_report(throughput, long_prompt, gemm, step)
    if args.json:
        doc = report.assemble(machine, throughput, long_prompt, gemm, step, agreement, [note] if note else [])
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _load(dtype: str, model_dir: Path):
    """Ours as users load it (the loader), the peer as transformers users do, SDPA attention."""
    from transformers import AutoModelForCausalLM

    from ..worker.loader import load_model

    ours = load_model(None, DTYPES[dtype], torch.device("cpu")).model
    peer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa").eval()
    return ours, peer


def _throughput(dtype, ours_model, peer_model, tokenizer, prompts, limits, args, model_dir):
    """Alternating rounds of the in-process systems, then vLLM; prints rounds and ratio lines."""
    k = min(args.single_subset, len(prompts))
    step_log: list = []
    systems: dict[str, tuple[Callable, int]] = {
        OURS: (lambda: run_ours(ours_model, tokenizer, prompts, limits, step_log), sum(limits)),
        CONTINUOUS: (lambda: run_hf_continuous(peer_model, prompts, limits), sum(limits)),
    }
    if args.record:            # the same engine recording every request, in the same rounds
        systems[RECORDING] = (lambda: run_ours(ours_model, tokenizer, prompts, limits, [], record=True), sum(limits))
    if dtype == "float32":     # the slow peers, kept for the fp32 table only
        systems[SINGLE] = (lambda: run_hf_single(peer_model, prompts[:k], limits[:k]), sum(limits[:k]))
        systems[PADDED] = (lambda: run_hf_padded(peer_model, prompts, limits), sum(limits))
    skip = {"single": SINGLE, "padded": PADDED, "continuous": CONTINUOUS}
    for s in args.skip:
        systems.pop(skip.get(s, ""), None)
    print(f"\n{dtype}: throughput")
    times: dict[str, list[float]] = {n: [] for n in systems}
    outputs: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        # Warm-up: first calls pay one-off costs (allocator, lazy inits) that are not throughput.
        for name in systems:
            _warm(name, ours_model, peer_model, tokenizer, prompts)
        for r in range(args.rounds):
            for name, (fn, _) in systems.items():
                if name == OURS:
                    step_log.clear()
                t0 = time.perf_counter()
                outputs[name] = fn()
                times[name].append(time.perf_counter() - t0)
                print(f"  round {r + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    ours_tokens = systems[OURS][1]
    rows = [report.system_row(name, tokens, times[name], ours_tokens, times[OURS])
            for name, (_, tokens) in systems.items()]
    if "vllm" not in args.skip:
        v = run_vllm(model_dir, prompts, limits, args.rounds, dtype)
        if v is None:
            print("vLLM CPU: not measured (no peer venv: run `make bench-peers` first)")
        else:
            name = f"vLLM CPU {v.get('version', '')} ({dtype})"
            # vLLM's repeats run in its own process after all our rounds: repeat i is paired with
            # our round i, not interleaved with it as the in-process systems are.
            rounds = v.get("round_seconds") or v.get("all_seconds") or [v["seconds"]]
            rows.append(report.system_row(name, v["generated_tokens"], rounds, ours_tokens, times[OURS]))
            outputs[name] = v["outputs"]
    for row in rows[1:]:
        print(report.ratio_line(row["system"], row["ours_over_per_round"]))
    for line in report.agreement_lines(dtype, outputs, OURS):
        print(line)
    full = [t for t in step_log if t.num_seqs >= 32]
    if full:
        total, fwd = sum(t.total_s for t in full), sum(t.launch_s for t in full)
        print(f"{dtype}: step time outside the model forward at >= 32 running sequences: "
              f"{(total - fwd) / total:.1%} over {len(full)} steps (median step "
              f"{statistics.median(t.total_s for t in full) * 1e3:.0f} ms)")
    return rows, outputs


def _long(ours_model, peer_model, tokenizer, args, dtype: str) -> dict:
    from .long_prompt import run_long

    print(f"\n{dtype}: long prompts, TTFT (ours) against prefill (transformers), alternating pairs")
    return run_long(ours_model, peer_model, tokenizer, args.long_prompts, args.long_rounds, dtype)


def _gemm_and_step(ours_model, tokenizer, args, dtype: str) -> tuple[dict, dict]:
    """The machine's GEMM peak over the model's shapes, then a profiled batch decode step."""
    from .gemm import measure, model_shapes
    from .step_profile import decode_flops, profile_decode

    print(f"\n{dtype}: GEMM peak (fastest of 5 passes at {', '.join(map(str, args.gemm_rows))} rows), then the "
          f"decode step at batch {args.step_batch}", flush=True)
    timings = measure(model_shapes(ours_model.config), args.gemm_rows, 5, DTYPES[dtype], stat=min)
    best = max(timings, key=lambda t: t.best_gflops)
    peak, peak_rows = best.best_gflops, best.rows
    prof = profile_decode(ours_model, tokenizer, args.step_batch, 64, args.step_steps)
    g = report.gemm_entry(peak, peak_rows, decode_flops(ours_model, args.step_batch), prof["gemm_s_per_step"])
    return g, prof


def _print_report(throughput: dict, long_prompt: dict, gemm: dict, step: dict) -> None:
    for dtype, rows in throughput.items():
        print(f"\n{dtype}: throughput (seconds: median round; ours / system: median of per-round ratios)")
        print("\n".join(report.throughput_table(rows)))
    if long_prompt:
        print("\nLong prompts: ours (TTFT, add_request to first token) / transformers (generate, "
              "max_new_tokens=1), alternating pairs")
        print("\n".join(report.long_table(long_prompt)))
    if step:
        print("\nWhere the decode step goes (batch of pure decode steps; shares of the profiled step's "
              "wall time; ms/step unprofiled; GEMM GFLOP/s against the packed-GEMM peak)")
        print("\n".join(report.step_table(step, gemm)))


def _warm(name, ours_model, peer_model, tokenizer, prompts) -> None:
    if name in (OURS, RECORDING):
        run_ours(ours_model, tokenizer, prompts[:2], [4, 4], [], record=name == RECORDING)
    elif name == CONTINUOUS:
        run_hf_continuous(peer_model, prompts[:2], [4, 4])
    elif name == PADDED:
        run_hf_padded(peer_model, prompts[:2], [4, 4])
    else:
        run_hf_single(peer_model, prompts[:1], [4])
