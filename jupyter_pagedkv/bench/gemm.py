"""`python -m jupyter_pagedkv.bench gemm`: the model's linear layers, stock vs packed, per batch size.

Why it exists: a decode step on the CPU is mostly GEMMs over the weights, so this is the number
that decides engine throughput there. It runs every linear layer of the model once per "pass"
(the shapes of one decode forward: 7 per Llama layer plus the output projection, every row
sampling),
with `torch.nn.functional.linear` on the plain weights and with the oneDNN-packed copies the
engine uses (`jupyter_pagedkv.worker.packed_linear`), alternating, and prints medians and the ratio.
Random weights of the model's shapes: speed does not depend on the values. `measure()` is the
reusable part: `bench throughput` takes the machine's GEMM peak from it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def layer_shapes(config) -> list[tuple[int, int]]:
    """(out_features, in_features) of the linears one decoder layer runs, in order."""
    h = config.hidden_size
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * d
    i = config.intermediate_size
    return [(heads * d, h), (kv, h), (kv, h), (h, heads * d), (i, h), (i, h), (h, i)]


def model_shapes(config) -> list[tuple[int, int]]:
    """Every linear of one decode forward: all layers, then the output projection."""
    return layer_shapes(config) * config.num_hidden_layers + [(config.vocab_size, config.hidden_size)]


@dataclass
class GemmTiming:
    """One row count's medians; packed_s is None where packing cannot run in this dtype."""

    rows: int
    flops: int
    stock_s: float
    packed_s: float | None

    def gflops(self, seconds: float | None) -> float | None:
        return None if not seconds else self.flops / seconds / 1e9

    @property
    def best_gflops(self) -> float:
        """The faster of the two paths: the peak a decode step's GEMMs can be held against."""
        return max(g for g in (self.gflops(self.stock_s), self.gflops(self.packed_s)) if g is not None)


def _can_pack(dtype: torch.dtype) -> bool:
    from jupyter_pagedkv.worker.packed_linear import packing_available

    if not packing_available():
        return False
    try:       # bf16 packing needs a oneDNN build and CPU that take it; ask, do not assume
        w = torch.zeros(8, 8, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype),
                                           torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return True
    except RuntimeError:
        return False


def measure(shapes: list[tuple[int, int]], rows_list: list[int], rounds: int,
            dtype: torch.dtype = torch.float32, seed: int = 0, stat=statistics.median) -> list[GemmTiming]:
    """Time one pass over `shapes` at each row count, stock and packed alternating; medians (or
    `stat=min`, the fastest pass, for a peak: on a shared machine a slow pass says nothing about
    what the cores can do)."""
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(shape, generator=g) * 0.02).to(dtype) for shape in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights] if _can_pack(dtype) else None
    out = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {s[1] for s in shapes}}
        flops = 2 * rows * sum(n * k for n, k in shapes)

        def stock() -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def fast() -> None:
            for w, p in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

        fns = [("stock", stock)] + ([("packed", fast)] if packed is not None else [])
        times: dict[str, list[float]] = {name: [] for name, _ in fns}
        with torch.inference_mode():
            for _, fn in fns:             # first calls create oneDNN primitives
                fn()
            for _ in range(rounds):
                for name, fn in fns:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        out.append(GemmTiming(rows, flops, stat(times["stock"]),
                              stat(times["packed"]) if packed is not None else None))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench gemm", description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512],
                    help="tokens per step (GEMM rows) to measure")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per row count")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and inputs")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoConfig

    from jupyter_pagedkv.worker.loader import embedded_model_dir
    from jupyter_pagedkv.worker.packed_linear import packing_available

    if not packing_available():
        print("this torch build has no oneDNN packed linear: nothing to compare")
        return 1
    dtype = DTYPES[args.dtype]
    config = AutoConfig.from_pretrained(embedded_model_dir())
    shapes = model_shapes(config)
    mb = sum(n * k for n, k in shapes) * dtype.itemsize / 2**20
    print(f"embedded model's linears: {len(shapes)} GEMMs per pass, {mb:.0f} MiB of {args.dtype} weights; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} "
          f"alternating rounds")
    if not _can_pack(dtype):
        print(f"oneDNN does not pack {args.dtype} weights here: the packed columns are empty")
    print("\n| rows | stock F.linear ms | packed ms | stock GFLOP/s | packed GFLOP/s | packed speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        t = measure(shapes, [rows], args.rounds, dtype)[0]
        p = t.packed_s
        print(f"| {rows} | {t.stock_s * 1e3:.1f} | {p * 1e3 if p else float('nan'):.1f} "
              f"| {t.gflops(t.stock_s):.1f} | {t.gflops(p) or float('nan'):.1f} "
              f"| {t.stock_s / p if p else float('nan'):.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
