"""`python -m jupyter_pagedkv.bench single`: one chat request at a time, ours vs transformers vs llama.cpp.

The notebook user's most common act is one `%%chat` turn: one sequence, whose decode reads every
weight once per token. Each round sends one chat prompt (3 prompts, cycled) to every system in
turn, in one process (llama.cpp in its own venv as a warm subprocess, `make bench-llamacpp`):
greedy, exactly --tokens tokens (EOS ignored), no prefix reuse between requests, after one warm-up
request each. Per request: TTFT (prompt in -> first token) and decode tokens/s ((tokens - 1) /
(last token - first token)). Every round is printed; the table gives medians and the ratios of
ours over each peer, with the CPU's ISA and the thread count.

Systems: ours with dense fp32 weights, ours with the GGUF's blocks kept packed (weights="packed"),
transformers `generate` in fp32 (the same dequantized weights as our dense engine), and llama.cpp
on the same GGUF file with as many threads as torch uses.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from .cli import at_least

REPO = Path(__file__).resolve().parents[2]
LLAMACPP_VENV = REPO / ".venv-llamacpp"
QUESTIONS = ("Tell me about the moon in one short paragraph.",
             "How do bees make honey? Explain it to a child.",
             "Give me three tips for keeping a small vegetable garden.")
DENSE, PACKED, HF, LLAMA = "ours, dense fp32", "ours, packed GGUF blocks", "transformers generate, fp32", "llama.cpp (same GGUF)"


SYSTEM_NAMES = ("dense", "packed", "hf", "llamacpp")     # --systems: what each names is in main()


def cpu_line() -> str:
    """The CPU's model name and the ISA features that decide these kernels' speed."""
    name, flags = platform.processor() or "cpu", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("cpu", "x86_64", ""):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name}; torch ISA {torch.backends.cpu.get_cpu_capability()}; flags {' '.join(isa) or 'unknown'}"


class Ours:
    """Our engine stepped here: TTFT and decode rate of one request."""

    def __init__(self, weights: str) -> None:
        from ..engine.engine import Engine
        self.engine = Engine.from_pretrained(None, device="cpu", dtype="float32", weights=weights,
                                             kv_cache_memory="256MiB", enable_prefix_caching=False)

    def describe(self) -> str:
        return self.engine.info().summary

    def run(self, ids: list[int], tokens: int) -> dict:
        from ..core.sampling_params import SamplingParams
        start = time.perf_counter()
        self.engine.add_request(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        first, out = None, None
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if first is None and o.token_ids:
                    first = time.perf_counter()
                if o.finished:
                    out = o
        end = time.perf_counter()
        return {"token_ids": list(out.token_ids), "ttft_s": first - start, "total_s": end - start}

    def close(self) -> None:
        self.engine.check_invariants()
        self.engine.shutdown()


class _Clock:
    """A generate() streamer that notes when the first new token arrives (its first put is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class Transformers:
    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM

        from ..worker.loader import embedded_model_dir
        self.model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()

    def run(self, ids: list[int], tokens: int) -> dict:
        clock = _Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                                      do_sample=False, streamer=clock, pad_token_id=2)
        end = time.perf_counter()
        return {"token_ids": out[0, len(ids):].tolist(), "ttft_s": clock.first - start, "total_s": end - start}

    def close(self) -> None:
        pass


class LlamaCpp:
    """peer_llamacpp.py in .venv-llamacpp, kept alive (warm) across rounds."""

    def __init__(self, gguf: Path, threads: int) -> None:
        python = LLAMACPP_VENV / "bin" / "python"
        self.proc = subprocess.Popen([str(python), str(Path(__file__).with_name("peer_llamacpp.py")), "--gguf",
                                      str(gguf), "--threads", str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self.proc.stdout.readline())

    def run(self, ids: list[int], tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt_token_ids": ids, "max_tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def alternate(calls: dict, reps: int, inner: int) -> dict[str, list[float]]:
    """Seconds per call of each of `calls`, `reps` times each, taking turns (so a slow minute of a
    shared machine hits all alike), each time the mean of `inner` calls; after one call each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for f in calls.values():
        f()
    for _ in range(reps):
        for name, f in calls.items():
            start = time.perf_counter()
            for _ in range(inner):
                f()
            times[name].append((time.perf_counter() - start) / inner)
    return times


def compare_gemms(reps: int = 7) -> None:
    """The GEMM choice for packed weights, measured: one activation row through the embedded
    model's first gate projection (1536 x 576, Q4_1) by our kernel (each int8-activation variant this
    CPU runs, and the best fp32-activation one: the decode path before quant_dot.cpp), torch's int4 and int8
    weight-only CPU ops (random quants of the same shape and group size) and oneDNN's fp32 GEMM
    on the dequantized weight; alternating, median and best of `reps` runs of 50 calls."""
    import gguf
    import numpy as np

    from ..worker.loader import embedded_gguf
    from ..worker.quant_linear import load_extension
    ops = load_extension()
    t = next(t for t in gguf.GGUFReader(str(embedded_gguf())).tensors if t.name == "blk.0.ffn_gate.weight")
    blocks = ops.quant_interleave(torch.from_numpy(np.array(t.data)), 3)      # the kernels' layout
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    n, k = w.shape
    g = torch.Generator().manual_seed(0)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g), 1)
    scales = torch.rand(k // 32, n, 2, generator=g) * 0.01
    int8w, scale8 = torch.randint(-127, 127, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g) * 0.01
    onednn = torch.ops.mkldnn._reorder_linear_weight(w)
    x = torch.randn(1, k, generator=g)
    variants = list(ops.quant_variants())
    int8 = [v for v in variants if not v.startswith("f32")]
    int8 = int8[1:] or int8                  # the portable variant only where there is no other
    calls = {f"ours, int8 activations ({v})": (lambda v=v: ops.quant_linear_isa(x, blocks, 3, None, 16, v)) for v in int8}
    calls[f"ours, fp32 activations ({variants[-1]})"] = lambda: ops.quant_linear_isa(x, blocks, 3, None, 16, variants[-1])
    calls["aten._weight_int4pack_mm_for_cpu"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, 32, scales)
    calls["aten._weight_int8pack_mm"] = lambda: torch.ops.aten._weight_int8pack_mm(x, int8w, scale8)
    calls["oneDNN fp32, dequantized weight"] = lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    times = {name: [t * 1e6 for t in ts] for name, ts in alternate(calls, reps, 50).items()}
    print(f"one row x {n}x{k} weight, {torch.get_num_threads()} threads:")
    for name, ts in times.items():
        print(f"  {name:40s} median {statistics.median(ts):8.1f} us, best {min(ts):8.1f} us")


def token_gemms(reps: int = 10) -> None:
    """Every packed GEMM of one decode token of the embedded model (q/k/v, o, gate/up, down per
    layer, then the output layer), one activation row each, back to back as the decode loop calls
    them, on one thread and on all of torch's; beside it, the floor: merely reading the same bytes
    (ATen's sum over each weight viewed as floats, in the same order). Decode of one sequence is
    bound by that floor once the kernel hides its arithmetic behind the reads; the gap between the
    two is what a faster kernel could still win. Median and best of `reps` passes, after one."""
    from ..worker.loader import load_model
    from ..worker.quant_linear import QuantLinear, load_extension
    ops = load_extension()
    model = load_model(None, torch.float32, torch.device("cpu"), weights="packed").model
    calls, seen = [], set()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            blocks = m.stack.blocks if m.stack is not None else m.blocks
            if id(blocks) not in seen:
                seen.add(id(blocks))
                calls.append((blocks, m.kind, torch.randn(1, m.in_features)))
    floats = [b.view(-1).view(torch.float32) for b, _, _ in calls]
    mib = sum(b.numel() for b, _, _ in calls) / 2**20
    threads = torch.get_num_threads()
    print(f"{len(calls)} GEMMs, {mib:.1f} MiB of blocks (quant_linear as the decode loop calls it):")
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            passes = {"GEMMs": lambda: [ops.quant_linear(x, b, kind, None, 8) for b, kind, x in calls],
                      "reading the bytes": lambda: [f.sum() for f in floats]}
            times = {name: [t * 1e3 for t in ts] for name, ts in alternate(passes, reps, 1).items()}
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"  {n} thread{'s' if n > 1 else ''}, {name:18s} median {med:6.2f} ms ({mib * 2**20 / med / 1e6:5.1f} GB/s), "
                      f"best {min(ts):6.2f} ms")
    finally:
        torch.set_num_threads(threads)


def decode_rate(r: dict, tokens: int) -> float:
    return (tokens - 1) / (r["total_s"] - r["ttft_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench single", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=at_least(2), default=128,
                    help="tokens generated per request (the first is TTFT, decode rates the rest)")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds (one prompt each, cycled); medians over them")
    ap.add_argument("--systems", default=",".join(SYSTEM_NAMES), help="comma-separated subset")
    ap.add_argument("--json", type=Path, help="write the rows and medians here")
    ap.add_argument("--gemms", action="store_true", help="only compare the GEMMs packed weights could use")
    ap.add_argument("--token-gemms", action="store_true",
                    help="only time every packed GEMM of one decode token against reading the same bytes")
    args = ap.parse_args(argv)
    wanted = {name.strip() for name in args.systems.split(",") if name.strip()}
    if not wanted or wanted - set(SYSTEM_NAMES):
        ap.error(f"--systems takes a comma-separated subset of {', '.join(SYSTEM_NAMES)}; got {args.systems!r}")
    if args.gemms:
        print(f"bench single --gemms, {date.today()}: {cpu_line()}")
        compare_gemms()
        return 0
    if args.token_gemms:
        print(f"bench single --token-gemms, {date.today()}: {cpu_line()}")
        token_gemms()
        return 0

    from ..worker.loader import embedded_gguf
    threads = torch.get_num_threads()
    notes: list[str] = []
    systems: dict[str, object] = {}
    if "dense" in wanted:
        systems[DENSE] = Ours("dense")
    if "packed" in wanted:
        systems[PACKED] = Ours("packed")
    if "hf" in wanted:
        systems[HF] = Transformers()
    if "llamacpp" in wanted:
        if (LLAMACPP_VENV / ".ok").exists():
            systems[LLAMA] = LlamaCpp(embedded_gguf(), threads)
        else:
            notes.append(f"llama.cpp skipped: {LLAMACPP_VENV.name} is not built (run `make bench-llamacpp`)")
    tokenizer = (systems.get(DENSE) or systems.get(PACKED) or Ours("packed")).engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    print(f"bench single, {date.today()}: {cpu_line()}")
    print(f"torch {torch.__version__}, {threads} threads; llama.cpp {threads} threads; embedded SmolLM2-135M "
          f"({embedded_gguf().name}); {args.tokens} greedy tokens, EOS ignored, no prefix reuse")
    for s in systems.values():                         # warm-up: one request each, not timed
        s.run(prompts[0], 8)
    for name, s in systems.items():                    # after the warm-up: the C++ loop has proven itself
        extra = s.describe() if isinstance(s, Ours) else (getattr(s, "info", {}) or {}).get("system_info", "")
        print(f"  {name}: {extra}" if extra else f"  {name}")
    for note in notes:
        print(f"  note: {note}")
    rows: dict[str, list[dict]] = {name: [] for name in systems}
    for rnd in range(args.rounds):
        ids = prompts[rnd % len(prompts)]
        for name, s in systems.items():
            r = s.run(ids, args.tokens)
            assert len(r["token_ids"]) == args.tokens, (name, len(r["token_ids"]))
            rows[name].append(r)
            print(f"round {rnd + 1} ({len(ids)}-token prompt) {name:28s} decode {decode_rate(r, args.tokens):7.1f} "
                  f"tok/s  TTFT {r['ttft_s'] * 1e3:7.1f} ms", flush=True)
    medians = {name: {"decode_tok_s": statistics.median(decode_rate(r, args.tokens) for r in rs),
                      "ttft_ms": statistics.median(r["ttft_s"] * 1e3 for r in rs)} for name, rs in rows.items()}
    print(f"\nmedians of {args.rounds} rounds:")
    print(f"| system | decode tokens/s | TTFT ms |\n|---|---:|---:|")
    for name, m in medians.items():
        print(f"| {name} | {m['decode_tok_s']:.1f} | {m['ttft_ms']:.0f} |")
    ratios = {}
    for ours in (PACKED, DENSE):
        for peer in (LLAMA, HF):
            if ours in rows and peer in rows:
                per_round = [decode_rate(a, args.tokens) / decode_rate(b, args.tokens)
                             for a, b in zip(rows[ours], rows[peer])]
                ratios[f"{ours} / {peer}"] = per_round
                print(f"decode {ours} / {peer}: median {statistics.median(per_round):.2f}x "
                      f"(rounds: {', '.join(f'{x:.2f}' for x in per_round)})")
    if DENSE in rows and PACKED in rows:
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows[DENSE], rows[PACKED]))
        print(f"packed vs dense: identical greedy outputs in {same} of {args.rounds} rounds")
    for s in systems.values():
        s.close()
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu_line(), "threads": threads, "medians": medians,
                                         "ratios": ratios, "notes": notes,
                                         "rounds": {n: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]
                                                    for n, rs in rows.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
