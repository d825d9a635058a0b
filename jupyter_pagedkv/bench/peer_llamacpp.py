"""llama.cpp (llama-cpp-python) answering one request at a time, for `bench single`.

Run it with its own venv, never with ``.venv`` (``make bench-llamacpp``, mk/llamacpp.mk)::

    .venv-llamacpp/bin/python jupyter_pagedkv/bench/peer_llamacpp.py --gguf FILE --threads 2

It loads the GGUF once, prints one JSON line ``{"ready": ..., "system_info": ...}``, then reads
requests as JSON lines ``{"prompt_token_ids": [...], "max_tokens": N}`` on stdin and answers each
with ``{"token_ids": [...], "ttft_s": ..., "total_s": ...}``: greedy, EOS ignored (exactly N
tokens), the KV cache cleared first (no prefix reuse between requests). Staying alive between
requests keeps it warm, as our engine is, and lets the caller alternate systems round by round.

This file deliberately does not import jupyter_pagedkv: it runs in a different venv.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=2048)
    args = p.parse_args(argv)

    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=args.n_ctx, n_batch=512, verbose=False)
    info = {"ready": True, "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        llm.reset()                    # no prefix reuse: every request computes its whole prompt
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        for token in llm.generate(req["prompt_token_ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                  repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) == req["max_tokens"]:
                break
        end = time.perf_counter()
        print(json.dumps({"token_ids": tokens, "ttft_s": first - start, "total_s": end - start}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
