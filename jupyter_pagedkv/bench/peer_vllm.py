"""Throughput of vLLM's CPU build on a fixed request set, for side-by-side benchmarks.

Run it with the peer venv, never with ``.venv`` (see ``mk/peers.mk`` and docs/peers.md)::

    .venv-peers/bin/python jupyter_pagedkv/bench/peer_vllm.py \\
        --model-dir DIR --requests REQ.json --out OUT.json

REQ.json is a list of ``{"prompt_token_ids": [...], "max_tokens": int}``. All requests of a set go
to vLLM in one ``generate`` call (greedy, ``ignore_eos``) so its own scheduler batches them, and
each request yields exactly ``max_tokens`` tokens, the same work our engine is given.

``--serve`` (`bench throughput --shapes`, through vllm_session.py) keeps one start for many request
sets *interleaved with our engine's runs*: after start-up it reads one JSON command a line from
stdin, ``{"name": str, "requests": [...]}``, times that set once (``--repeats`` is for the file
mode) and answers one line, ``PEER_RESULT {json}``, until stdin closes. Its first line is
``PEER_RESULT {"ready": true, "version", "startup_seconds"}``. Answers go to the process's original
stdout; everything else printed to stdout (vLLM's logs) is sent to stderr, and a reader still
skips lines without the marker. Why: with our engine's
shapes in one block and vLLM's in another minutes later, the host's drift landed in the ratio
(docs/benchmarks.md, sixth measurement); an idle vLLM waits on its queue (~1% of a core here).

This file deliberately does not import jupyter_pagedkv: it runs in a different venv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Iterable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="plain Hugging Face folder (safetensors)")
    p.add_argument("--requests", help="JSON list of prompt_token_ids/max_tokens")
    p.add_argument("--out", help="where to write the result JSON")
    p.add_argument("--serve", action="store_true", help="request sets from stdin, results to stdout (see above)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--kv-space-gib", type=int, default=1)
    # Start-up costs over a minute here, so repeating the timed run in one process is cheap.
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    args = p.parse_args(argv)
    # vLLM's CPU attention kernels only take blocks in multiples of 32.
    if args.block_size <= 0 or args.block_size % 32:
        p.error("--block-size must be a positive multiple of 32")
    if not args.serve and not (args.requests and args.out):
        p.error("--requests and --out are needed (or --serve)")
    if args.kv_space_gib <= 0 or args.repeats <= 0:
        p.error("--kv-space-gib and --repeats must be positive")
    return args


def set_env(kv_space_gib: int) -> None:
    """Set vLLM's environment before it is imported (it reads some variables at import)."""
    # The KV cache size on the CPU comes from this variable, not from gpu_memory_utilization.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    # Keep vLLM's caches out of $HOME; a caller may point it elsewhere.
    os.environ.setdefault(
        "VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "jupyter-pagedkv-vllm-cache")
    )
    # No network here: fail fast instead of waiting on hub look-ups or usage reports.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        os.environ.setdefault(name, "1")


def load_requests(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return _check(json.load(f), path)


def _check(reqs: Any, where: str) -> list[dict[str, Any]]:
    """The request list itself, or SystemExit naming what is wrong with it (`where`: a file or a
    --serve set's name)."""
    if not isinstance(reqs, list) or not reqs:
        raise SystemExit(f"{where}: expected a non-empty JSON list")
    for i, r in enumerate(reqs):
        if not isinstance(r, dict) or not r.get("prompt_token_ids") or int(r.get("max_tokens", 0)) <= 0:
            raise SystemExit(f"{where}: request {i} needs prompt_token_ids and max_tokens > 0")
    return reqs


def timed(llm, reqs: list[dict[str, Any]], repeats: int, params) -> dict[str, Any]:
    """`repeats` cold runs of one request set: every repeat's seconds, the outputs, the tokens."""
    prompts = [{"prompt_token_ids": list(r["prompt_token_ids"])} for r in reqs]
    sampling = [params(int(r["max_tokens"])) for r in reqs]
    runs = []
    for _ in range(repeats):
        # Every system starts each timed run cold: our engine and transformers' manager are new
        # per round, so the blocks of the warm-up and of the previous repeat must not hit here.
        if not llm.reset_prefix_cache():
            raise SystemExit("vLLM could not reset its prefix cache; the repeats would not start cold")
        t1 = time.perf_counter()
        results = llm.generate(prompts, sampling, use_tqdm=False)
        runs.append(time.perf_counter() - t1)
    outputs = [list(res.outputs[0].token_ids) for res in results]
    for i, (out, r) in enumerate(zip(outputs, reqs)):
        if len(out) != int(r["max_tokens"]):
            raise SystemExit(f"request {i}: got {len(out)} tokens, asked for {r['max_tokens']}")
    generated = sum(len(o) for o in outputs)
    seconds = statistics.median(runs)
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "outputs": outputs, "all_seconds": runs, "round_seconds": runs, "requests": len(reqs)}


RESULT = "PEER_RESULT "


def serve(llm, params: Callable[[int], Any], lines: Iterable[str], write: Callable[[str], Any],
          warm: Callable[[list[dict[str, Any]]], Any]) -> int:
    """The --serve loop: each line of `lines` one request set, timed once, answered by `write`
    (one `RESULT` line). `warm(reqs)` runs untimed before the first set. A bad command is answered
    with {"error": ...} and the loop goes on. Returns the sets served."""
    served = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            name = str(cmd["name"])
            reqs = _check(cmd["requests"], name)
        except (ValueError, KeyError, TypeError, AttributeError, SystemExit) as err:
            write(RESULT + json.dumps({"error": f"bad command: {err}"}))
            continue
        if not served:
            warm(reqs)
        write(RESULT + json.dumps({"name": name} | timed(llm, reqs, 1, params)))
        served += 1
    return served


def private_stdout() -> Any:
    """The --serve answers' own stream: the original stdout, duplicated, while fd 1 itself now
    points at stderr, so vLLM's log lines (and its children's, which inherit fd 1) cannot land
    inside an answer that spans more than one pipe write."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return answers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_env(args.kv_space_gib)
    answers = private_stdout() if args.serve else None
    reqs = None if args.serve else load_requests(args.requests)

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    t0 = time.perf_counter()
    # enforce_eager: torch.compile would add a minute or more to every start on this machine.
    llm = LLM(
        model=args.model_dir,
        dtype=args.dtype,
        block_size=args.block_size,
        enforce_eager=True,
        seed=0,
        disable_log_stats=True,
    )
    startup_s = time.perf_counter() - t0

    def warm(reqs: list[dict[str, Any]]) -> None:
        """Untimed: first-call allocations and kernel dispatch stay out of the measurement."""
        first = [{"prompt_token_ids": r["prompt_token_ids"][:16]} for r in reqs[:2]]
        llm.generate(first, [params(8)] * len(first), use_tqdm=False)

    if args.serve:
        def write(line: str) -> None:
            answers.write(line + "\n")
            answers.flush()

        write(RESULT + json.dumps({"ready": True, "version": vllm.__version__, "startup_seconds": startup_s}))
        serve(llm, params, sys.stdin, write, warm)
        return 0
    warm(reqs)

    one = timed(llm, reqs, args.repeats, params)
    seconds, generated, runs = one["seconds"], one["generated_tokens"], one["all_seconds"]

    report = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "outputs": one["outputs"],
        # Threads of this driver process. The model runs in vLLM's worker process, whose
        # OpenMP threads follow VLLM_CPU_OMP_THREADS_BIND ("auto" keeps a core for the
        # scheduler process: 1 worker thread on a 2-core machine).
        "threads": torch.get_num_threads(),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "all_seconds": runs,
        # Every repeat in order, so a caller can pair them with its own rounds (same as all_seconds,
        # under the name `bench throughput` reads).
        "round_seconds": runs,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "requests": len(reqs),
        "startup_seconds": startup_s,
    }
    with open(args.out, "w") as f:
        json.dump(report, f)
    print(
        f"vllm-cpu {vllm.__version__} {args.dtype}: {generated} tokens in {seconds:.2f} s = "
        f"{generated / seconds:.1f} tok/s (median of {len(runs)}; startup {startup_s:.1f} s, "
        f"bind {report['omp_threads_bind']})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
