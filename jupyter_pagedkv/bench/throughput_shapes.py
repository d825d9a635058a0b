"""`python -m jupyter_pagedkv.bench throughput --shapes N`: ours against vLLM CPU on N seeded
workload shapes, and the minimum ratio over them (issue #37's throughput acceptance).

Why a minimum: one prompt set can flatter an engine; the shapes (sim/workload.py: short and long
outputs, one shared or one system prompt per request, 8 to 64 requests) vary what the scheduler
and the model runner feel, and the claim is the worst of them. The first table per dtype is like
for like (dense weights, the KV cache in the model's dtype: what vLLM CPU runs); with
`--weights packed` and/or `--kv-cache-dtype X` a second table runs ours with them against the same
vLLM runs. Both engines keep their default prefix caching and start every round cold. vLLM starts
once per dtype (its start-up costs a minute or more) and stays up (vllm_session.py); then, round
after round, every shape runs on ours and on vLLM back to back, who goes first alternating shape by
shape, so the host's drift (±20-50% over minutes here) falls on both sides of each ratio alike;
vLLM's round i pairs with ours. Greedy, EOS ignored: every request generates its max_tokens.

JSON (--json PATH): {machine, shapes: [{name, seed, requests, outputs, prefix}], vllm: {dtype:
version or null}, tables: {dtype: {label: {rows: [{shape, requests, tokens, ours_round_seconds,
ours_tokens_per_s, peer_round_seconds, peer_tokens_per_s, ours_over_per_round, ours_over}],
minimum: [ratio, shape] or null, agreement: {shape: identical outputs}}}}, notes: [...]}.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import throughput_report as report
from ..sim.workload import draw_shapes, shape_requests
from .throughput import DTYPES, PEER_VENV, parse_args, run_ours
from . import vllm_session
from .vllm_session import PeerFailed, VllmSession

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
        ours, peer = _run_interleaved(dtype, configs, tokenizer, model_dir, work, args, notes)
        versions[dtype] = peer.get("version") if peer else None
        tables[dtype] = {label: _table(shapes, work, times_outs, peer) for label, times_outs in ours.items()}
    for line in notes:
        print(line)
    for dtype, by_label in tables.items():
        peer = f"vLLM CPU {versions[dtype]}" if versions[dtype] else "vLLM CPU (not measured)"
        for label, t in by_label.items():
            print(f"\n{dtype}, ours {label} / {peer}; tokens/s of the median round; per-round ratios "
                  f"pair our round i with vLLM's round i")
            print("\n".join(report.shapes_table(t["rows"], "vLLM CPU")))
            m = t["minimum"]
            print(f"{dtype}: minimum ours / vLLM CPU over {len(t['rows'])} shapes: "
                  + (f"{m[0]:.2f}x ({m[1]})" if m else "not measured (the notes above say why)"))
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
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.weights != "dense" or options:
        configs.append((f"{args.weights} weights, KV cache {args.kv_cache_dtype}", args.weights, options))
    return configs


def _tokenized(tokenizer, shape) -> tuple[list[list[int]], list[int]]:
    reqs = shape_requests(shape)
    prompts = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in reqs]
    return prompts, [r.max_tokens for r in reqs]


def _run_interleaved(dtype: str, configs: list[tuple[str, str, dict]], tokenizer, model_dir: Path,
                     work: dict[str, tuple[list[list[int]], list[int]]], args, notes: list[str]
                     ) -> tuple[dict[str, tuple[dict, dict]], dict | None]:
    """Every shape, `args.rounds` times, on each of our configs and on vLLM back to back, who
    goes first alternating from shape to shape (and, per shape, from round to round).

    Returns ({label: (times {shape: [s per round]}, outputs {shape: last round's})}, peer) where
    peer is {"version", "workloads": {shape: {generated_tokens, round_seconds, outputs}}}, or None
    (no peer venv, `--skip vllm`, or the peer failed: said in `notes`)."""
    from ..worker.loader import load_model

    runs = _Interleaving(tokenizer, notes)
    for label, weights, options in configs:
        if weights == "packed" and dtype != "float32":
            notes.append(f"{dtype}: no '{label}' table: packed weights compute in fp32")
            continue
        runs.models[label] = (load_model(None, DTYPES[dtype], torch.device("cpu"), weights=weights).model, options)
    runs.session = _start_vllm(model_dir, dtype, args.skip, notes)
    print(f"\n{dtype}: ours ({'; '.join(runs.models)})"
          + (" and vLLM CPU, shape by shape, who goes first alternating" if runs.session else ", shape by shape"),
          flush=True)
    try:
        with torch.inference_mode():
            first = next(iter(work.values()))[0]
            for model, options in runs.models.values():
                run_ours(model, tokenizer, first[:2], [4, 4], [], **options)     # warm-up, untimed
            for r in range(args.rounds):
                for i, (name, (prompts, limits)) in enumerate(work.items()):
                    runs.shape_round(r, name, prompts, limits, vllm_first=(r + i) % 2 == 1)
    finally:
        # No session left (never started, or failed midway): no vLLM figure at all.
        version = runs.session.version if runs.session is not None else None
        if runs.session is not None:
            runs.session.close()
    ours = {label: (runs.times[label], runs.outputs[label]) for label in runs.models}
    runs.models.clear()
    gc.collect()
    return ours, ({"version": version, "workloads": runs.peer_sets} if version is not None else None)


@dataclass
class _Interleaving:
    """What `_run_interleaved` accumulates: our models and their times and outputs per shape, the
    kept vLLM session and its runs."""

    tokenizer: object
    notes: list[str]
    models: dict[str, tuple[object, dict]] = field(default_factory=dict)
    session: VllmSession | None = None
    times: dict[str, dict[str, list[float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    outputs: dict[str, dict[str, list[list[int]]]] = field(default_factory=lambda: defaultdict(dict))
    peer_sets: dict[str, dict] = field(default_factory=dict)

    def shape_round(self, r: int, name: str, prompts: list[list[int]], limits: list[int], vllm_first: bool) -> None:
        """Round `r` of one shape: every config of ours and vLLM, back to back."""
        vllm_first = vllm_first and self.session is not None
        if vllm_first:
            self._vllm(name, prompts, limits)
        for label, (model, options) in self.models.items():
            served: list[float] = []     # the engine's construction left out, as vLLM's start is
            self.outputs[label][name] = run_ours(model, self.tokenizer, prompts, limits, [], served=served, **options)
            self.times[label][name].append(served[0])
        if self.session is not None and not vllm_first:
            self._vllm(name, prompts, limits)
        line = ", ".join(f"ours{'' if k == 0 else ' (second table)'} {self.times[label][name][-1]:.1f} s"
                         for k, label in enumerate(self.models))
        if self.session is not None:
            line += f", vLLM {self.peer_sets[name]['round_seconds'][-1]:.1f} s"
        print(f"  round {r + 1}: {name}: {line}{' (vLLM first)' if vllm_first else ''}", flush=True)

    def _vllm(self, name: str, prompts: list[list[int]], limits: list[int]) -> None:
        """One timed run of a shape on the kept vLLM. A failure ends the session (`session` None):
        every vLLM figure of this dtype is then dropped, as a table with some rounds missing
        would mislead."""
        try:
            res = self.session.run(name, [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, limits)])
        except PeerFailed as err:
            print(err, file=sys.stderr)
            self.notes.append(f"vLLM CPU failed during {name}: no vLLM figures for this dtype")
            self.session.close()
            self.session = None
            return
        entry = self.peer_sets.setdefault(name, {"generated_tokens": 0, "round_seconds": [], "outputs": []})
        entry["generated_tokens"], entry["outputs"] = res["generated_tokens"], res["outputs"]
        entry["round_seconds"].append(res["seconds"])


def _start_vllm(model_dir: Path, dtype: str, skip: list[str], notes: list[str]) -> VllmSession | None:
    """vLLM started for this dtype, or None with the reason in `notes` (every table then shows
    ours alone)."""

    if "vllm" in skip:
        notes.append(f"{dtype}: vLLM CPU not measured (--skip vllm)")
        return None
    if not (PEER_VENV / ".ok").exists():
        notes.append(f"{dtype}: vLLM CPU not measured (no {PEER_VENV}/.ok: run `make bench-peers` first)")
        return None
    print(f"{dtype}: starting vLLM CPU (once, kept up for every shape)", flush=True)
    session = vllm_session.start(PEER_VENV / "bin" / "python", model_dir, dtype)
    if session is None:
        notes.append(f"{dtype}: vLLM CPU failed to start (its error above): ours alone")
    else:
        print(f"{dtype}: vLLM CPU {session.version} up in {session.startup_seconds:.0f} s", flush=True)
    return session


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
