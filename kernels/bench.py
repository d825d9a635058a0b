"""Decode-attention benchmark: the paged Triton kernel against the device's copy bandwidth and
against contiguous `scaled_dot_product_attention` on the same K/V.

    python -m jupyter_pagedkv.bench kernels          # on a GPU: the full grid
    python -m jupyter_pagedkv_kernels.bench --smoke  # anywhere: tiny sizes (CPU: Triton interpreter)

For each batch x context it prints the paged kernel's median time and achieved bandwidth (K/V
bytes read / time), that bandwidth as a fraction of the copy bandwidth measured in the same run,
SDPA's time on a contiguous copy of the same K/V, and the ratio paged / contiguous. On CUDA both
are timed as CUDA-graph replays (the device's time, as the engine's graphed decode steps run
them), and the paged call is also timed as an eager launch (`launch_ms`: Python's launch cost
included, what an eager step pays per layer); the first H200 run timed eager calls only, and its
small sizes measured the ~0.17 ms launch, not the kernel.
Copy bandwidth counts bytes read + bytes written (a copy of N bytes moves 2N), the usual
convention for "achievable DRAM bandwidth"; decode only reads, so the two are comparable.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

FULL_BATCHES = (1, 16, 64, 256)
FULL_CONTEXTS = (512, 2048, 8192, 32768)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes that run in seconds; on a CPU through Triton's interpreter")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--heads", type=int, default=32, help="query heads (default: Llama-3-8B's 32)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--memory-fraction", type=float, default=0.8,
                   help="skip a size whose tensors would take more than this share of free memory")
    return p.parse_args(argv)


def _median_ms(fn, device: torch.device, smoke: bool, graph: bool = False) -> float:
    """Median milliseconds: on CUDA triton.testing.do_bench (CUDA events, L2 flushed; the host's
    launch cost shows when it exceeds the kernel's) or, with `graph`, do_bench_cudagraph (calls
    captured in one CUDA graph and replayed: the device's time; no L2 flush, so a case under the
    L2's size reads from it); else a wall-clock median."""
    if device.type == "cuda":
        import triton.testing
        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(1 if smoke else 5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, smoke: bool) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, smoke)
    return 2 * src.nbytes / (ms * 1e-3)


def _make_case(batch: int, context: int, args, dtype, device, generator):
    """A paged cache holding `batch` sequences of `context` tokens in shuffled physical blocks,
    plus one decode query per sequence; every sequence's K/V is also returned contiguous."""
    bs = args.block_size
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=generator).to(device)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    shape = (num_blocks, bs, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=device)
    idx = block_tables.long()
    k_dense = k_cache[idx].view(batch, -1, args.kv_heads, args.head_dim)[:, :context]
    v_dense = v_cache[idx].view(batch, -1, args.kv_heads, args.head_dim)[:, :context]
    k_dense = k_dense.transpose(1, 2).contiguous()            # [B, kv_heads, ctx, d]
    v_dense = v_dense.transpose(1, 2).contiguous()
    return query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_dense, v_dense


def _case_bytes(batch: int, context: int, args, elem: int) -> int:
    """Peak device memory of a case: paged K/V, their contiguous copy, one gather temporary."""
    kv = 2 * batch * (-(-context // args.block_size) * args.block_size) * args.kv_heads * args.head_dim * elem
    return int(2.6 * kv)


def _header(device: torch.device) -> list[str]:
    import triton
    lines = [f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}"]
    if device.type == "cuda":
        lines.append(f"device: {torch.cuda.get_device_name(device)}")
    else:
        lines.append(f"device: cpu ({platform.processor() or platform.machine()}), "
                     f"{torch.get_num_threads()} threads, Triton interpreter: "
                     f"{os.environ.get('TRITON_INTERPRET', '0')}")
    return lines


def measure(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns its facts as plain data (what `main` prints, and what the GPU
    check puts in its report): header lines, copy bandwidth, one dict per batch x context."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            raise SystemExit("bench kernels: no CUDA device; the full benchmark needs a GPU "
                             "(use --smoke to exercise it on the CPU through Triton's interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")    # read when kernel modules load
    if args.smoke:
        args.heads, args.kv_heads, args.head_dim = min(args.heads, 4), min(args.kv_heads, 2), 64
    batches = args.batches or ((1, 2) if args.smoke else FULL_BATCHES)
    contexts = args.contexts or ((40, 100) if args.smoke else FULL_CONTEXTS)
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    copy_bytes = (1 << 20) if args.smoke else (2 << 30)
    result = {"header": _header(device), "device": device.type, "copy_buffer_mib": copy_bytes >> 20,
              "copy_bandwidth_gbs": copy_bandwidth(device, copy_bytes, args.smoke) / 1e9,
              "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                        "block_size": args.block_size, "dtype": args.dtype},
              "rows": []}
    scale = args.head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        for context in contexts:
            row = {"batch": batch, "context": context}
            need = _case_bytes(batch, context, args, elem)
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            if free is not None and need > args.memory_fraction * free:
                row["skipped"] = f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            else:
                try:
                    row.update(_run_case(batch, context, args, dtype, device, gen, scale,
                                         result["copy_bandwidth_gbs"] * 1e9))
                except torch.OutOfMemoryError:
                    row["skipped"] = "out of memory"
            result["rows"].append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return result


COLUMNS = ("batch", "context", "splits", "paged_ms", "paged_gbs", "of_copy", "sdpa_ms", "paged_over_sdpa",
           "max_diff", "launch_ms")


def main(argv: list[str] | None = None) -> int:
    try:
        result = measure(argv)
    except SystemExit as stop:
        print(stop)
        return 2
    for line in result["header"]:
        print(line)
    print(f"copy bandwidth (read + write, {result['copy_buffer_mib']} MiB buffer): "
          f"{result['copy_bandwidth_gbs']:.1f} GB/s")
    shape = result["shape"]
    print(f"decode: heads {shape['heads']}, kv_heads {shape['kv_heads']}, head_dim {shape['head_dim']}, "
          f"block_size {shape['block_size']}, {shape['dtype']}; one query token per sequence")
    print(" ".join(f"{c:>10}" for c in ("batch", "context", "splits", "paged_ms", "paged_GB/s",
                                         "of_copy", "sdpa_ms", "paged/sdpa", "max_diff", "launch_ms")))
    for row in result["rows"]:
        head = f"{row['batch']:>10} {row['context']:>10}"
        if "skipped" in row:
            print(f"{head}  skipped: {row['skipped']}")
            continue
        line = (f"{head} {row['splits']:>10} {row['paged_ms']:>10.4f} {row['paged_gbs']:>10.1f} "
                f"{row['of_copy']:>10.1%}")
        if "sdpa_ms" in row:
            line += f" {row['sdpa_ms']:>10.4f} {row['paged_over_sdpa']:>10.2f} {row['max_diff']:>10.2e}"
        else:
            line += "   sdpa: out of memory"
        line += f" {row['launch_ms']:>10.4f}" if "launch_ms" in row else f" {'-':>10}"
        print(line + (f"  ({row['timing']})" if "timing" in row else ""))
    if result["device"] == "cuda":
        print("targets (H200): of_copy >= 80% at batch >= 64 and context >= 2048; paged/sdpa <= 1.15")
    return 0


def _run_case(batch, context, args, dtype, device, gen, scale, copy_bw) -> dict:
    """Time one batch x context; returns its row."""
    from .paged_attention import launch_config, paged_attention
    from .reference import contiguous_attention

    elem = torch.empty((), dtype=dtype).element_size()
    q, kc, vc, bt, sl, qsl, kd, vd = _make_case(batch, context, args, dtype, device, gen)
    splits = launch_config(batch, batch, args.heads, args.kv_heads, elem, context,
                           device)[3]
    out = torch.empty_like(q)

    def paged():
        paged_attention(q, kc, vc, bt, sl, qsl, scale, max_seq_len=context, out=out)

    q4 = q.unsqueeze(2)                                   # [B, heads, 1, d]

    def contiguous():
        return contiguous_attention(q4, kd, vd, scale)

    paged()
    row: dict = {"splits": splits}
    graph = device.type == "cuda"
    if graph:
        row["launch_ms"] = _median_ms(paged, device, args.smoke)
        try:
            paged_ms = _median_ms(paged, device, args.smoke, graph=True)
        except Exception as err:            # noqa: BLE001 - a failed capture is a finding, not an end
            graph, paged_ms = False, row.pop("launch_ms")
            row["timing"] = _capture_failed("paged", err)
    else:
        paged_ms = _median_ms(paged, device, args.smoke)
    try:
        diff = (out.float() - contiguous().squeeze(2).float()).abs().max().item()
        sdpa_ms = None
        if graph:
            try:
                sdpa_ms = _median_ms(contiguous, device, args.smoke, graph=True)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:        # noqa: BLE001 - both sides eager then: the ratio stays like for like
                paged_ms = row.pop("launch_ms")
                row["timing"] = _capture_failed("SDPA", err)
        if sdpa_ms is None:
            sdpa_ms = _median_ms(contiguous, device, args.smoke)
    except torch.OutOfMemoryError:          # e.g. a backend that expands the KV heads
        sdpa_ms = None
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elem
    bw = kv_bytes / (paged_ms * 1e-3)
    row.update(paged_ms=paged_ms, paged_gbs=bw / 1e9, of_copy=bw / copy_bw)
    if sdpa_ms is None:
        return row
    return {**row, "sdpa_ms": sdpa_ms, "paged_over_sdpa": paged_ms / sdpa_ms, "max_diff": diff}


def _capture_failed(side: str, err: Exception) -> str:
    """One table-safe line: which capture failed and why (both sides are then timed eagerly)."""
    why = " ".join(str(err).split())[:120].replace("|", "/")
    return f"eager: the {side} graph capture failed ({type(err).__name__}: {why})"

if __name__ == "__main__":
    sys.exit(main())
