"""`python -m jupyter_pagedkv.bench memory`: what packing costs in memory, and what unloading frees.

For each dtype, three engines on the embedded model, each built by `Engine.from_pretrained` (as
`%pagedkv load` builds it) in a fresh process, so that nothing one leaves behind counts for the
next: plain torch GEMMs (`pack_weights=False`, the weights once, unpacked), packed weights held
once (the default), and packed copies beside the plain weights (`keep_plain_weights=True`, the old
way). Each reports the process's resident memory (anonymous + file-backed, from /proc) above what
it had before loading: after the load, after a short generation, and after the engine is shut
down and dropped as `%pagedkv unload` does. "Packing costs" is the packed engine's resident
memory over the unpacked one's, as a share of the weights' size.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CONFIGS = {"plain GEMMs (no packing)": {"pack_weights": False},
           "packed, held once (default)": {},
           "packed + plain copies": {"keep_plain_weights": True}}


def resident_mib() -> float:
    """This process's resident memory (anonymous + file-backed), MiB."""
    from ..worker.host_memory import rss_bytes

    return rss_bytes() / 2**20


def measure(dtype: str, options: dict) -> dict:
    """One configuration, in this process (run it in a fresh one)."""
    import gc

    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine
    from ..worker.host_memory import return_freed_memory

    return_freed_memory()
    base = resident_mib()
    engine = Engine.from_pretrained(None, dtype=dtype, kv_cache_memory="64MiB", **options)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**20
    kv = (engine.info().kv_bytes or 0) / 2**20
    return_freed_memory()
    loaded = resident_mib() - base
    engine.generate(["Name three rivers in Europe."], SamplingParams(max_tokens=16, temperature=0.0))
    return_freed_memory()
    served = resident_mib() - base
    summary = engine.info().summary
    engine.shutdown()
    del engine
    gc.collect()
    return_freed_memory()
    return {"weights_mib": weights, "kv_mib": kv, "loaded_mib": loaded, "after_generate_mib": served,
            "after_unload_mib": resident_mib() - base, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench memory", description=__doc__)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--one", nargs=2, metavar=("DTYPE", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:                                  # the child process: one measurement, as JSON
        print(json.dumps(measure(args.one[0], CONFIGS[args.one[1]])))
        return 0
    from ..gpucheck.report import cpu_isa

    print(f"CPU: {cpu_isa()}; resident memory (anonymous + file-backed) above the level before "
          f"loading, MiB; each row a fresh process; KV cache 64 MiB")
    results: dict[str, dict] = {}
    for dtype in args.dtype:
        rows = results[dtype] = {}
        for name in CONFIGS:
            proc = subprocess.run([sys.executable, "-m", "jupyter_pagedkv.bench", "memory", "--one", dtype, name],
                                  capture_output=True, text=True, check=True)
            rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        plain = rows["plain GEMMs (no packing)"]
        print(f"\n{dtype}: weights {plain['weights_mib']:.0f} MiB\n"
              f"| engine | after load | after generate | after unload | packing costs |\n|---|---:|---:|---:|---:|")
        for name, r in rows.items():
            cost = (r["after_generate_mib"] - plain["after_generate_mib"]) / plain["weights_mib"]
            r["packing_costs_share"] = cost
            print(f"| {name} | {r['loaded_mib']:.0f} | {r['after_generate_mib']:.0f} | "
                  f"{r['after_unload_mib']:.0f} | {'' if r is plain else f'{cost:+.1%}'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_isa(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
