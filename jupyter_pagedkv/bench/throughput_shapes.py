"""`python -m jupyter_pagedkv.bench throughput --shapes N`: ours against vLLM CPU on N seeded
workload shapes, and the minimum ratio over them (issue #37's throughput acceptance).

Why a minimum: one prompt set can flatter an engine; the shapes (sim/workload.py: short and long
outputs, one shared or one system prompt per request, 8 to 64 requests) vary what the scheduler
and the model runner feel, and the claim is the worst of them. The first table per dtype is like
for like (dense weights, the KV cache in the model's dtype: what vLLM CPU runs); with
`--weights packed` and/or `--kv-cache-dtype X` a second table runs ours with them against the same
vLLM runs. Both engines keep their default prefix caching and start every round cold. Ours runs all
rounds of all shapes first, then vLLM runs them in one start (its start-up costs a minute or more),
its repeat i paired with our round i. Greedy, EOS ignored: every request generates its max_tokens.

JSON (--json PATH): {machine, shapes: [{name, seed, requests, outputs, prefix}], vllm: {dtype:
version or null}, tables: {dtype: {label: {rows: [{shape, requests, tokens, ours_round_seconds,
ours_tokens_per_s, peer_round_seconds, peer_tokens_per_s, ours_over_per_round, ours_over}],
minimum: [ratio, shape] or null, agreement: {shape: identical outputs}}}}, notes: [...]}.
"""
from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import torch

from . import throughput_report as report
from ..sim.workload import draw_shapes, shape_requests
from .throughput import DTYPES, PEER_VENV, parse_args, run_ours, run_peer_vllm

LIKE_FOR_LIKE = "like for like (dense weights, KV cache in the model's dtype)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shapes <= 0:
        raise SystemExit(f"--shapes needs a positive number of shapes, got {args.shapes}")
    from transformers import AutoTokenizer

    from ..worker.loader import embedded_model_dir

    dtypes, note = report.choose_dtypes(args.dtype)
    model_dir = embedded_model_dir()
    return run_shapes(args, AutoTokenizer.from_pretrained(model_dir), model_dir, dtypes, note)


def run_shapes(args, tokenizer, model_dir: Path, dtypes: list[str], note: str | None) -> int:
    from ..worker.loader import EMBEDDED_NAME

    shapes = draw_shapes(args.shapes, args.shape_seed)
    work = {s.name: _tokenized(tokenizer, s) for s in shapes}
    machine = report.machine_info(EMBEDDED_NAME, torch.__version__, torch.get_num_threads())
    print(f"model: {machine['model']}; CPU: {machine['cpu']} (ISA: {machine['isa']}; native bf16: "
          f"{machine['native_bf16'] or 'none'}); torch {machine['torch']}, {machine['threads']} threads")
    print(f"{len(shapes)} workload shapes (seed {args.shape_seed}), greedy, EOS ignored, {args.rounds} rounds each:")
    for s in shapes:
        prompts, limits = work[s.name]
        print(f"  {s.name}: {s.requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
              f"tokens, {s.prefix} system prompt, {sum(limits)} tokens to generate")
    notes = [note] if note else []
    configs = _configs(args, notes)
    tables, versions = {}, {}
    for dtype in dtypes:
        ours = {}
        for label, weights, options in configs:
            if weights == "packed" and dtype != "float32":
                notes.append(f"{dtype}: no '{label}' table: packed weights compute in fp32")
                continue
            ours[label] = _run_ours_shapes(dtype, weights, options, tokenizer, work, args.rounds, label)
        peer = _run_vllm_sets(model_dir, work, args.rounds, dtype) if "vllm" not in args.skip else None
        versions[dtype] = peer.get("version") if peer else None
        tables[dtype] = {label: _table(shapes, work, times_outs, peer) for label, times_outs in ours.items()}
    for line in notes:
        print(line)
    for dtype, by_label in tables.items():
        peer = f"vLLM CPU {versions[dtype]}" if versions[dtype] else "vLLM CPU (not measured)"
        for label, t in by_label.items():
            print(f"\n{dtype}, ours {label} / {peer}; tokens/s of the median round; per-round ratios "
                  f"pair our round i with vLLM's repeat i")
            print("\n".join(report.shapes_table(t["rows"], "vLLM CPU")))
            m = t["minimum"]
            print(f"{dtype}: minimum ours / vLLM CPU over {len(t['rows'])} shapes: "
                  + (f"{m[0]:.2f}x ({m[1]})" if m else "not measured (no peer venv: `make bench-peers`)"))
            if t["agreement"]:
                print(f"{dtype}: greedy outputs identical to vLLM's, per shape: "
                      + ", ".join(f"{k} {v}" for k, v in t["agreement"].items()))
    if args.json:
        doc = {"machine": machine, "shapes": [dataclasses.asdict(s) for s in shapes], "vllm": versions,
               "tables": tables, "notes": notes}
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _configs(args, notes: list[str]) -> list[tuple[str, str, dict]]:
    """(label, weights, engine options): like for like, then the second table's if asked."""
    configs = [(LIKE_FOR_LIKE, "dense", {})]
    options = {}
    if args.kv_cache_dtype != "auto":
        from ..config import EngineConfig
        if "kv_cache_dtype" not in {f.name for f in dataclasses.fields(EngineConfig)}:
            raise SystemExit("--kv-cache-dtype needs the quantized KV cache (issue #37), which this build "
                             "does not have: leave it at auto")
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.weights != "dense" or options:
        configs.append((f"{args.weights} weights, KV cache {args.kv_cache_dtype}", args.weights, options))
    return configs


def _tokenized(tokenizer, shape) -> tuple[list[list[int]], list[int]]:
    reqs = shape_requests(shape)
    prompts = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in reqs]
    return prompts, [r.max_tokens for r in reqs]


def _run_ours_shapes(dtype, weights, options, tokenizer, work, rounds, label) -> tuple[dict, dict]:
    """Every shape, `rounds` times (round after round over all shapes, so drift spreads evenly)."""
    from ..worker.loader import load_model

    model = load_model(None, DTYPES[dtype], torch.device("cpu"), weights=weights).model
    times: dict[str, list[float]] = {name: [] for name in work}
    outputs: dict[str, list[list[int]]] = {}
    print(f"\n{dtype}: ours, {label}", flush=True)
    with torch.inference_mode():
        first = next(iter(work.values()))[0]
        run_ours(model, tokenizer, first[:2], [4, 4], [], **options)     # warm-up, untimed
        for r in range(rounds):
            for name, (prompts, limits) in work.items():
                served: list[float] = []     # the engine's construction left out, as vLLM's start is
                outputs[name] = run_ours(model, tokenizer, prompts, limits, [], served=served, **options)
                times[name].append(served[0])
                print(f"  round {r + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    del model
    gc.collect()
    return times, outputs


def _table(shapes, work, times_outs, peer: dict | None) -> dict:
    times, outputs = times_outs
    rows, agreement = [], {}
    for s in shapes:
        tokens = sum(work[s.name][1])
        p = (peer or {}).get("workloads", {}).get(s.name)
        rows.append(report.shape_row(s.name, s.requests, tokens, times[s.name],
                                     p["generated_tokens"] if p else None, p["round_seconds"] if p else []))
        if p:
            agreement[s.name] = f"{sum(a == b for a, b in zip(outputs[s.name], p['outputs']))}/{s.requests}"
    return {"rows": rows, "minimum": report.minimum_ratio(rows), "agreement": agreement}


def _run_vllm_sets(model_dir: Path, work: dict, repeats: int, dtype: str) -> dict | None:
    """vLLM CPU on every shape in one start of peer_vllm.py (its own venv), or None without it."""
    if not (PEER_VENV / ".ok").exists():
        print(f"vLLM CPU: not measured (no {PEER_VENV}/.ok: run `make bench-peers` first)")
        return None
    print(f"\n{dtype}: vLLM CPU, every shape in one start", flush=True)
    payload = {"workloads": {name: [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(*w)]
                             for name, w in work.items()}}
    return run_peer_vllm(model_dir, payload, repeats, dtype, timeout=7200)
