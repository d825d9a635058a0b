"""`python -m jupyter_pagedkv.bench gemm`: the model's linear layers, stock vs packed, per batch size.

Why it exists: a decode step on the CPU is mostly GEMMs over the weights, so this is the number
that decides engine throughput there. It runs every linear layer of the model once per "pass"
(the shapes of one decode forward: 7 per Llama layer plus the output projection, every row
sampling),
with `torch.nn.functional.linear` on the plain weights and with the oneDNN-packed copies the
engine uses (`jupyter_pagedkv.worker.packed_linear`), alternating, and prints medians and the ratio.
Random weights of the model's shapes: speed does not depend on the values.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def layer_shapes(config) -> list[tuple[int, int]]:
    """(out_features, in_features) of the linears one decoder layer runs, in order."""
    h = config.hidden_size
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * d
    i = config.intermediate_size
    return [(heads * d, h), (kv, h), (kv, h), (h, heads * d), (i, h), (i, h), (h, i)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench gemm", description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512],
                    help="tokens per step (GEMM rows) to measure")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per row count")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoConfig

    from jupyter_pagedkv.worker.loader import embedded_model_dir
    from jupyter_pagedkv.worker.packed_linear import packing_available

    if not packing_available():
        print("this torch build has no oneDNN packed linear: nothing to compare")
        return 1
    config = AutoConfig.from_pretrained(embedded_model_dir())
    shapes = layer_shapes(config) * config.num_hidden_layers
    head = (config.vocab_size, config.hidden_size)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g) * 0.02 for shape in shapes + [head]]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    mb = sum(w.numel() for w in weights) * 4 / 2**20
    print(f"embedded model's linears: {len(weights)} GEMMs per pass, {mb:.0f} MiB of fp32 weights; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} "
          f"alternating rounds")
    print("\n| rows | stock F.linear ms | packed ms | stock GFLOP/s | packed GFLOP/s | packed speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=g) for k in {s[1] for s in shapes + [head]}}
        flops = 2 * rows * sum(n * k for n, k in shapes + [head])

        def stock() -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def fast() -> None:
            for w, p in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

        times: dict[str, list[float]] = {"stock": [], "packed": []}
        with torch.inference_mode():
            stock(), fast()                       # first calls create oneDNN primitives
            for _ in range(args.rounds):
                for name, fn in (("stock", stock), ("packed", fast)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        s, p = statistics.median(times["stock"]), statistics.median(times["packed"])
        print(f"| {rows} | {s * 1e3:.1f} | {p * 1e3:.1f} | {flops / s / 1e9:.1f} | {flops / p / 1e9:.1f} "
              f"| {s / p:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
