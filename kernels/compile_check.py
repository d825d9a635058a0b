"""Compile every kernel variant the engine can launch for the real GPUs, here, with no GPU.

Triton's wheel ships `ptxas` and `cuobjdump`, so `triton.compile` produces sm_90 (H200/H100) and
sm_80 (A100) cubins on a CPU machine. For each model shape below, `variants.model_launches` builds
the launches the engine makes (on meta tensors: nothing is allocated), and Triton's own binder
turns each launch's arguments into the signature, constexprs and specialisation attributes its
JIT would compile -- so the check cannot drift from the launchers. Launches whose binder key is
equal are the same compiled kernel (Triton's cache would reuse it), so each key compiles once.

The GGUF block GEMM (`quant_matmul.py`, weights="packed" on CUDA) adds its own variants, the
same for every model. Per variant: registers and spill bytes (stack frame + local memory per thread, from
`cuobjdump -res-usage` on the cubin) and shared memory (`metadata.shared`, what Triton checks
against the device at load time). Fails on a compile error, any spill, or shared memory above the
target's per-block opt-in limit.

    python -m jupyter_pagedkv.bench compile [--arch 90 80] [--quick] [--jsonl PATH] [-j N]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

import torch
import triton

from .paged_attention import MAX_SPLITS, choose_num_splits, launch_config
from .quant_matmul import variant_launches as quant_matmul_variants
from .variants import AttentionShape, model_launches

# Shared memory one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SHARED_LIMIT = {90: 232448, 80: 166912}
SMS = {90: 132, 80: 108}                    # H200/H100 SXM, A100: SM counts for the split heuristic
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# kv_cache_dtype -> the cache's storage dtype ("auto": the compute dtype's own)
KV_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
QUANTIZED = ("fp8_e4m3", "int8")
FP8_MIN_ARCH = 89      # Triton's fp8e4nv (e4m3) exists from sm_89 (Ada, Hopper); sm_80 has no e4m3 type


def compiles_on(shape: AttentionShape, arch: int) -> bool:
    """Whether `shape`'s kernels exist for sm_`arch`: an fp8 e4m3 cache only from sm_89 (the engine
    refuses kv_cache_dtype="fp8_e4m3" with the Triton backend below it; int8 runs everywhere)."""
    return shape.kv_dtype != torch.float8_e4m3fn or arch >= FP8_MIN_ARCH


@dataclass(frozen=True)
class Model:
    """A model as the kernels see it (jupyter_pagedkv/testing/models.py and the README name these)."""
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    context: int
    dtypes: tuple[str, ...] = ("bf16",)
    block_sizes: tuple[int, ...] = (16,)
    kv_dtypes: tuple[str, ...] = ("auto",)

    def shapes(self) -> list[AttentionShape]:
        return [AttentionShape(self.heads, self.kv_heads, self.head_dim, DTYPES[d], bs, self.window, KV_DTYPES[kv])
                for d in self.dtypes for bs in self.block_sizes for kv in self.kv_dtypes]


ALL_DTYPES = tuple(DTYPES)
# The models "variants per model" is printed for (the shapes in jupyter_pagedkv/testing/models.py; Mistral-7B's window).
NAMED = (Model("SmolLM2-135M", 9, 3, 64, None, 8192),
         Model("Llama-3-8B", 32, 8, 128, None, 8192),
         Model("Mistral-7B (window 4096)", 32, 8, 128, 4096, 32768))
# What the GPU check runs: its tiny exactness and architecture models (fp32; heads of 16, 32 and
# 64, windows of 8 and 48), the SmolLM2-135M shape in fp32 and bf16, the Llama-3-8B shape in bf16.
GPU_CHECK = (Model("tiny (head 16)", 4, 2, 16, None, 512, ("fp32",)),
             Model("tiny window 8", 4, 2, 16, 8, 512, ("fp32",)),
             Model("tiny window 48", 4, 2, 16, 48, 512, ("fp32",)),
             Model("tiny phi3 (GQA 1)", 4, 4, 16, None, 512, ("fp32",)),
             Model("tiny qwen3 (head 32)", 4, 2, 32, None, 512, ("fp32",)),
             Model("tiny gqa64", 6, 2, 64, None, 512, ("fp32",)),
             Model("tiny gqa64 window 48", 6, 2, 64, 48, 512, ("fp32",)),
             Model("SmolLM2-135M", 9, 3, 64, None, 8192, ("fp32", "bf16")),
             Model("Llama-3-8B", 32, 8, 128, None, 8192, ("bf16",)),
             # kv_cache_dtype "fp8_e4m3" / "int8": the quantized cache's write and attention kernels
             # (bf16 only, ~25 more variants, so the quick check keeps to its 40 s; the full grid has all)
             Model("SmolLM2-135M, quantized KV", 9, 3, 64, None, 8192, ("bf16",), kv_dtypes=QUANTIZED),
             Model("Llama-3-8B, quantized KV", 32, 8, 128, None, 8192, ("bf16",), kv_dtypes=QUANTIZED))


def full_models() -> tuple[Model, ...]:
    """Heads of 64 and 128, GQA groups 1-8, block sizes 16/32, three dtypes, window on and off,
    each KV cache dtype (the model's, fp8 e4m3, int8)."""
    grid = tuple(Model(f"head {d}, GQA {g}{', window' if w else ''}", kv * g, kv, d, w, 32768,
                       ALL_DTYPES, (16, 32), tuple(KV_DTYPES))
                 for d, kv in ((64, 3), (128, 8)) for g in range(1, 9) for w in (None, 4096))
    return GPU_CHECK + grid


# -- binding: Triton's own path from launch arguments to a compile job ---------------------------

def _binding(launch, target):
    """(key, src, options) exactly as `JITFunction.run` derives them, minus the device."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit as triton_jit

    backend = make_backend(target)
    kernel = launch.kernel
    binder = triton_jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**launch.constexprs, **launch.options}
    bound, specialization, options = binder(*launch.args, **kwargs)
    key = (launch.name, tuple(specialization), str(options))
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return key, ASTSource(kernel, signature, constexprs, attrs), options


@dataclass
class Variant:
    """One compiled kernel for one architecture and what the compiler says about it."""
    kernel: str
    arch: int
    config: str                         # the constexprs, compactly
    dtype: str
    models: list[str] = field(default_factory=list)
    registers: int | None = None
    spill_bytes: int | None = None
    shared: int | None = None
    seconds: float | None = None
    error: str | None = None


def failures(v: Variant) -> list[str]:
    """Why this variant would not run well (or at all) on its architecture; empty when fine."""
    where = f"{v.kernel} sm_{v.arch} {v.config}"
    if v.error:
        return [f"{where}: compile error: {v.error}"]
    problems = []
    if v.spill_bytes:
        problems.append(f"{where}: spills {v.spill_bytes} bytes per thread")
    if v.shared is not None and v.shared > SHARED_LIMIT[v.arch]:
        problems.append(f"{where}: shared memory {v.shared} B above the sm_{v.arch} limit "
                        f"{SHARED_LIMIT[v.arch]} B")
    return problems


_RES_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, spill bytes) of the one function in `cubin`, read with the wheel's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    match = _RES_USAGE.search(text)
    if not match:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line: {text[:200]!r}")
    regs, stack, _static_shared, local = map(int, match.groups())
    return regs, max(stack, local)


def _describe(launch) -> tuple[str, str]:
    c = launch.constexprs
    dtype = str(launch.args[0].dtype).replace("torch.", "")
    if c.get("QUANT") or "INT8" in c:       # a quantized cache: its codes' dtype after the compute dtype's
        dtype += "/" + str(launch.args[2].dtype).replace("torch.", "").replace("float8_e4m3fn", "fp8")
    skip = {"HEAD_DIM_PAD", "PRECISION", "DOT_FP32", "MAX_SPLITS", "BLOCK", "CHUNK", "HEADS_PAD", "DIM_PAD"}
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in c.items()
                    if k not in skip), dtype


def compile_launch(launch, arch: int) -> Variant:
    """Compile one launch for sm_`arch` and read its resources."""
    from triton.backends.compiler import GPUTarget

    config, dtype = _describe(launch)
    variant = Variant(launch.name, arch, config, dtype)
    target = GPUTarget("cuda", arch, 32)
    start = time.perf_counter()
    try:
        _, src, options = _binding(launch, target)
        compiled = triton.compile(src, target=target, options=options.__dict__)
        variant.shared = int(compiled.metadata.shared)
        variant.registers, variant.spill_bytes = resource_usage(compiled.asm["cubin"])
    except Exception as err:     # reported as this variant's failure, never hidden
        variant.error = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}"
    variant.seconds = round(time.perf_counter() - start, 2)
    return variant


# -- enumeration ---------------------------------------------------------------------------------

def distinct_launches(models, arch: int) -> list[tuple[object, list[str]]]:
    """[(launch, model names)] with one launch per distinct binder key, in first-seen order."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    seen: dict[tuple, tuple[object, list[str]]] = {}
    for model in models:
        for shape in (s for s in model.shapes() if compiles_on(s, arch)):
            for _, launch in model_launches(shape, "meta", interpreted=False):
                key = _binding(launch, target)[0]
                entry = seen.setdefault(key, (launch, []))
                if model.name not in entry[1]:
                    entry[1].append(model.name)
    for launch in quant_matmul_variants("meta"):         # weights="packed" on CUDA: any model's GGUF blocks
        seen.setdefault(_binding(launch, target)[0], (launch, ["GGUF blocks"]))
    return list(seen.values())


def variants_after(model: Model, arch: int = 90) -> int:
    """Distinct compiled kernels one model (its first dtype and block size) needs now."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    shape = model.shapes()[0]
    return len({_binding(launch, target)[0] for _, launch in model_launches(shape, "meta", interpreted=False)})


def variants_before(model: Model, arch: int = 90, max_num_seqs: int = 256) -> int:
    """Compiled kernels the same model needed while NUM_SPLITS was a constexpr (and the window
    was switched on only when a step's context passed it): one attention kernel per split count
    `choose_num_splits` can return, per tile, times two for a windowed model, one merge kernel per
    split count above 1, plus write_kv and copy_blocks. A lower bound: the batch size and block
    table width were specialised too (== 1, multiple of 16), which this does not count."""
    shape = model.shapes()[0]
    elem = torch.empty((), dtype=shape.dtype).element_size()
    tile_n = launch_config(1, 1, model.heads, model.kv_heads, elem, None, torch.device("meta"),
                           interpreted=False)[2]
    lengths = range(tile_n, model.context + 4 * tile_n, tile_n)     # every split boundary
    per_tile = {}
    for block_m in (16, 64):                    # the decode and the prefill tile
        block_q = block_m // (model.heads // model.kv_heads)
        if block_m == 16:                       # decode: one token per sequence
            programs = {(triton.cdiv(b, block_q) + b) * model.kv_heads for b in range(1, max_num_seqs + 1)}
        else:                                   # prefill: any number of rows
            programs = {m * model.kv_heads for m in range(2, 4096)}
        # a grid of 2 x SMs or more never splits: one such size stands for all of them
        programs = {p for p in programs if p < 2 * SMS[arch]} | {2 * SMS[arch]}
        per_tile[block_m] = {choose_num_splits(p, min(n, model.context), torch.device("meta"), tile_n,
                                               num_sms=SMS[arch])
                             for p in programs for n in lengths}
    attention = sum(len(s) for s in per_tile.values())
    if model.window is not None and model.context > model.window:
        attention *= 2
    merges = {n for s in per_tile.values() for n in s if n > 1}
    return attention + len(merges) + 2


# -- the run -------------------------------------------------------------------------------------

def _job(args: tuple[int, int, bool]) -> Variant:
    index, arch, quick = args
    launch, names = _JOBS[(arch, quick)][index]
    variant = compile_launch(launch, arch)
    variant.models = names
    return variant


_JOBS: dict[tuple[int, bool], list] = {}


def _collect(finished, done: dict, sink) -> None:
    """Keep each variant as it finishes and append its JSON row at once (a run cut short keeps
    every row it compiled)."""
    for job, variant in finished:
        done[job] = variant
        if sink:
            sink.write(json.dumps(asdict(variant)) + "\n")
            sink.flush()


def _print_table(variants: list[Variant]) -> None:
    print(f"{'kernel':<24} {'sm':>3} {'dtype':<9} {'regs':>4} {'spill':>5} {'shared':>7} {'s':>5}  config")
    for v in variants:
        cells = (f"{v.registers:>4} {v.spill_bytes:>5} {v.shared:>7}" if v.error is None
                 else f"{'-':>4} {'-':>5} {'-':>7}")
        print(f"{v.kernel:<24} {v.arch:>3} {v.dtype:<9} {cells} {v.seconds:>5}  {v.config}"
              + (f"  ERROR {v.error}" if v.error else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench compile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SHARED_LIMIT),
                        help="compute capabilities to compile for (default: 90 80)")
    parser.add_argument("--quick", action="store_true", help="only the GPU check's models")
    parser.add_argument("--jsonl", help="append one JSON object per variant as it is compiled")
    parser.add_argument("-j", "--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="parallel compile processes (default: the CPUs, at most 8)")
    args = parser.parse_args(argv)
    models = GPU_CHECK if args.quick else full_models()
    start = time.perf_counter()
    print(f"triton {triton.__version__}, torch {torch.__version__}; "
          f"{'GPU check models' if args.quick else 'full grid'}; sm {' '.join(map(str, args.arch))}; "
          f"{args.jobs} processes", flush=True)
    jobs = []
    for arch in args.arch:
        _JOBS[(arch, args.quick)] = distinct_launches(models, arch)
        jobs += [(i, arch, args.quick) for i in range(len(_JOBS[(arch, args.quick)]))]
    print(f"{len(jobs)} distinct variants to compile", flush=True)
    done: dict[tuple[int, int, bool], Variant] = {}
    sink = open(args.jsonl, "a") if args.jsonl else None
    try:
        if args.jobs > 1:       # fork: the children inherit the kernels package loaded by path
            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = {pool.submit(_job, job): job for job in jobs}
                finished = ((futures[f], f.result()) for f in as_completed(futures))
                _collect(finished, done, sink)
        else:
            _collect(((job, _job(job)) for job in jobs), done, sink)
    finally:
        if sink:
            sink.close()
    variants = [done[job] for job in jobs]
    _print_table(variants)
    ok = [v for v in variants if v.error is None]
    if ok:
        top_regs = max(ok, key=lambda v: v.registers)
        top_shared = max(ok, key=lambda v: v.shared)
        print(f"largest registers: {top_regs.registers} ({top_regs.kernel} sm_{top_regs.arch} {top_regs.config}); "
              f"largest shared memory: {top_shared.shared} B ({top_shared.kernel} sm_{top_shared.arch} "
              f"{top_shared.config})")
    print("variants per model (one dtype, block size 16; before: NUM_SPLITS constexpr):")
    for model in NAMED:
        print(f"  {model.name}: before >= {variants_before(model)}, now {variants_after(model)}")
    print(f"compiled {len(variants)} variants in {time.perf_counter() - start:.0f} s (split counts 1-{MAX_SPLITS} share each split variant)")
    problems = [p for v in variants for p in failures(v)]
    for line in problems:
        print("FAIL", line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
