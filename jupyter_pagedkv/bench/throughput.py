"""`python -m jupyter_pagedkv.bench throughput`: our engine against peers on one seeded workload.

All in-process systems run alternately, round after round, on the same weights and prompts; the
table reports medians. vLLM's CPU build runs in its own venv (`make bench-peers`) as a subprocess
of the same command. Every request generates exactly its max_tokens (EOS ignored), greedy, fp32.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from .hf_peers import hf_continuous, hf_padded, hf_single
from ..sim.workload import chat_requests

REPO = Path(__file__).resolve().parents[2]
PEER_VENV = REPO / ".venv-peers"


def run_ours(model, tokenizer, prompts, limits, step_log: list) -> list[list[int]]:
    """Our engine, stepped here; `step_log` receives every step's phase timings."""
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine

    engine = Engine(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=2048)
    engine.step_timings = step_log
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


def run_vllm(model_dir: Path, prompts, limits, repeats: int) -> dict | None:
    python = PEER_VENV / "bin" / "python"
    if not (PEER_VENV / ".ok").exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        req.write_text(json.dumps([{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, limits)]))
        cmd = [str(python), str(Path(__file__).with_name("peer_vllm.py")), "--model-dir", str(model_dir),
               "--requests", str(req), "--out", str(out), "--dtype", "float32", "--repeats", str(repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            print(f"vLLM CPU failed (exit {proc.returncode}):\n{proc.stderr[-1500:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench throughput", description=__doc__)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the in-process systems")
    ap.add_argument("--single-subset", type=int, default=8,
                    help="requests timed for one-at-a-time generate (it is slow; tokens/s is per request)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["single", "padded", "continuous", "vllm"])
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jupyter_pagedkv.worker.loader import embedded_model_dir

    model_dir = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reqs = chat_requests(args.requests)
    prompts = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in reqs]
    limits = [r.max_tokens for r in reqs]
    ours_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                      attn_implementation="sdpa").eval()
    k = min(args.single_subset, len(prompts))
    step_log: list = []
    systems: dict[str, tuple[Callable, int]] = {
        "jupyter-pagedkv": (lambda: run_ours(ours_model, tokenizer, prompts, limits, step_log), sum(limits)),
        "HF generate, one at a time": (lambda: run_hf_single(peer_model, prompts[:k], limits[:k]), sum(limits[:k])),
        "HF generate, padded batches of 8": (lambda: run_hf_padded(peer_model, prompts, limits), sum(limits)),
        "HF continuous batching": (lambda: run_hf_continuous(peer_model, prompts, limits), sum(limits)),
    }
    skip = {"single": "HF generate, one at a time", "padded": "HF generate, padded batches of 8",
            "continuous": "HF continuous batching"}
    for s in args.skip:
        systems.pop(skip.get(s, ""), None)

    print(f"workload: {len(prompts)} chat requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, max_tokens 16-128 (seeded), {sum(limits)} tokens to generate; greedy, fp32, EOS ignored")
    print(f"machine: torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rounds} alternating rounds, medians")
    with torch.inference_mode():
        # Warm-up: first calls pay one-off costs (allocator, lazy inits) that are not throughput.
        for name in systems:
            _warm(name, ours_model, peer_model, tokenizer, prompts, limits)
        times: dict[str, list[float]] = {n: [] for n in systems}
        outputs: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            for name, (fn, _) in systems.items():
                if name == "jupyter-pagedkv":
                    step_log.clear()
                t0 = time.perf_counter()
                outputs[name] = fn()
                times[name].append(time.perf_counter() - t0)
                print(f"  round {r + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    rows = []
    for name, (fn, tokens) in systems.items():
        sec = statistics.median(times[name])
        rows.append((name, tokens, sec, tokens / sec))
    if "vllm" not in args.skip:
        v = run_vllm(model_dir, prompts, limits, args.rounds)
        if v is None:
            print("vLLM CPU: not measured (no peer venv: run `make bench-peers` first)")
        else:
            rows.append((f"vLLM CPU {v.get('version', '')} (fp32)", v["generated_tokens"], v["seconds"],
                         v["tokens_per_s"]))
            outputs[rows[-1][0]] = v["outputs"]
    ours_tps = rows[0][3]
    print(f"\n| system | tokens | seconds | tokens/s | ours / system |\n|---|---:|---:|---:|---:|")
    for name, tokens, sec, tps in rows:
        print(f"| {name} | {tokens} | {sec:.1f} | {tps:.1f} | {ours_tps / tps:.2f}x |")
    ref = outputs["jupyter-pagedkv"]
    for name, outs in outputs.items():
        if name != "jupyter-pagedkv":
            same = sum(a == b for a, b in zip(ref, outs))
            print(f"greedy outputs identical to ours: {name}: {same}/{len(outs)}")
    full = [t for t in step_log if t.num_seqs >= 32]
    if full:
        step, fwd = sum(t.total_s for t in full), sum(t.launch_s for t in full)
        print(f"step time outside the model forward at >= 32 running sequences: "
              f"{(step - fwd) / step:.1%} over {len(full)} steps (median step "
              f"{statistics.median(t.total_s for t in full) * 1e3:.0f} ms)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "threads": torch.get_num_threads()}, indent=2))
    return 0


def _warm(name, ours_model, peer_model, tokenizer, prompts, limits) -> None:
    if name == "jupyter-pagedkv":
        run_ours(ours_model, tokenizer, prompts[:2], [4, 4], [])
    elif name == "HF continuous batching":
        run_hf_continuous(peer_model, prompts[:2], [4, 4])
    elif name.startswith("HF generate, padded"):
        run_hf_padded(peer_model, prompts[:2], [4, 4])
    else:
        run_hf_single(peer_model, prompts[:1], [4])
