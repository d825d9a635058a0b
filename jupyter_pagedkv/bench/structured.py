"""What structured outputs cost a decode step: the embedded model at batch B (32), every request
plain or every request under one JSON schema, alternating in one process (the machine's load
moves; medians over rounds).

Each run records `StepTiming`s; the figures are medians over decode steps with all B sequences in
the batch: the whole step, its sampling part and, within sampling, the grammar mask (filling the
bitmask rows on the host and applying them: `StepTiming.mask_s`), and the mask's share of the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CITIES = ["Paris", "Rome", "Madrid", "Berlin", "Lisbon", "Vienna", "Prague", "Warsaw", "Athens", "Dublin",
          "Oslo", "Helsinki", "Stockholm", "Copenhagen", "Brussels", "Amsterdam", "Bern", "Budapest",
          "Sofia", "Zagreb", "Riga", "Vilnius", "Tallinn", "Bratislava", "Ljubljana", "Valletta", "Nicosia",
          "Luxembourg", "Reykjavik", "Tokyo", "Cairo", "Lima"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "country", "continent", "population_millions", "landmarks"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench structured", description=__doc__)
    ap.add_argument("--batch", type=int, default=32, help="requests per run (all decode together)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="alternating pairs (plain, schema)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap.parse_args(argv)


def run_once(engine, prompts: list, max_tokens: int, schema: dict | None) -> dict:
    """One batch; the medians of its full-batch decode steps (seconds)."""
    from ..core.sampling_params import SamplingParams
    from ..core.structured_outputs import StructuredOutputsParams
    from ..worker.step_timing import summarize

    spec = StructuredOutputsParams(json=schema) if schema is not None else None
    engine.step_timings = []
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=spec is None, structured_outputs=spec))
    summary = summarize(engine.step_timings, min_decode=len(prompts))
    engine.step_timings = None
    summary["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    if spec is not None:
        summary["valid"] = sum(_valid(o.outputs[0].text) for o in outs)
    return summary


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from ..engine.engine import Engine
    from ..gpucheck.report import cpu_isa

    engine = Engine.from_pretrained(None, device="cpu", dtype="float32", max_num_seqs=max(args.batch, 1))
    cities = (CITIES * (args.batch // len(CITIES) + 1))[:args.batch]
    prompts = [engine.apply_chat_template([{"role": "user", "content": f"Describe {c} as JSON."}]) for c in cities]
    run_once(engine, prompts[:2], 4, SCHEMA)       # warm: kernels, the compiler, the schema's cache
    rows: dict[str, list[dict]] = {"plain": [], "schema": []}
    for _ in range(args.rounds):
        rows["plain"].append(run_once(engine, prompts, args.max_tokens, None))
        rows["schema"].append(run_once(engine, prompts, args.max_tokens, SCHEMA))
    engine.stop()
    print(f"CPU: {cpu_isa()}; torch threads {torch.get_num_threads()}; batch {args.batch}, "
          f"{args.rounds} alternating rounds, medians over full-batch decode steps")
    result = {}
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs if k in r) * 1e3
               for k in ("total_s", "sample_s", "mask_s")}
        steps = sum(r.get("steps", 0) for r in runs)
        result[name] = {**{k.replace("_s", "_ms"): v for k, v in med.items()}, "steps": steps,
                        **({"valid": [r["valid"] for r in runs]} if name == "schema" else {})}
        result[name]["mask_share"] = med["mask_s"] / med["total_s"] if med["total_s"] else 0.0
        print(f"{name:>7}: step {med['total_s']:.1f} ms, sampling {med['sample_s']:.1f} ms, "
              f"grammar mask {med['mask_s']:.1f} ms = {100 * result[name]['mask_share']:.0f}% of the step "
              f"({steps} steps)"
              + (f"; complete, valid JSON {result[name]['valid']} of {args.batch}" if name == "schema" else ""))
    slower = result["schema"]["total_ms"] / result["plain"]["total_ms"] - 1
    print(f"a JSON schema on every request: step {100 * slower:+.1f}%")
    result["slowdown"] = slower
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_isa(), "batch": args.batch, **result}, indent=2))
    return 0
