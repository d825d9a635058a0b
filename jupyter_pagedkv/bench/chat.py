"""Second-turn chat latency through the magics: TTFT with the prefix cache vs without it.

`python -m jupyter_pagedkv.bench chat`. Each repetition resets a `%%chat` session, sends a long
first message, then a short second one, and records the second turn's TTFT. Configurations
(`%pagedkv load` with and without `--no-prefix-caching`) alternate within one process, and the
cache is cleared at the start of every repetition, so the only reuse measured is turn 1 -> turn 2.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics

FIRST = (
    "Note {rep}. I keep a small allotment and want a planting plan for next year. The plot is ten "
    "metres by four, slopes gently to the south, and gets full sun from late morning until evening. "
    "The soil is heavy clay that stays wet in winter and cracks in August; I have added compost for "
    "two years and it is slowly getting better. Last season the tomatoes split after heavy rain, the "
    "carrots forked in the clay, the courgettes produced far more than we could eat, and slugs took "
    "most of the lettuce in May. The runner beans did well along the north fence, and the potatoes "
    "were fine but I lost a row to blight in late July. I have a compost bay, two water butts and a "
    "small cold frame, but no greenhouse. I can visit three evenings a week and most weekends. We "
    "eat a lot of salad, onions, garlic, beans and squash, and I would like to try sweetcorn and "
    "leeks. I also want to keep one bed for flowers for cutting, to bring pollinators in, and I would "
    "rather not use slug pellets. Please think about crop rotation across four beds, what to sow "
    "under cover and when, how to improve the drainage without digging everything over, and how to "
    "spread the harvest so that we do not get a glut of everything in the same fortnight."
)
SECOND = "Thanks. Which one change would help the most next year?"


def run_pair(ip, rep: int, first_tokens: int, session) -> dict:
    """One conversation of two turns; returns the second turn's figures."""
    ip.run_line_magic("pagedkv", "reset-cache")
    if "bench" in session.chats:
        ip.run_line_magic("chat", "bench --reset")
    ip.run_cell_magic("chat", f"bench --max-tokens {first_tokens}", FIRST.format(rep=rep))
    ip.run_cell_magic("chat", "bench --max-tokens 2", SECOND)
    out = session.chats["bench"].outputs[-1]
    return {"ttft": out.metrics.ttft, "cached": out.num_cached_tokens,
            "prompt": len(out.prompt_token_ids)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per configuration (median)")
    ap.add_argument("--first-tokens", type=int, default=24, help="reply length of the first turn")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    args = ap.parse_args(argv)

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from jupyter_pagedkv.notebook.session import current

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_pagedkv")
    session = current()
    configs = {"prefix cache on": "", "prefix cache off": " --no-prefix-caching"}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; embedded model, CPU, fp32; "
          f"{args.reps} repetitions per configuration, alternating")
    for rep in range(args.reps):
        for name, flag in configs.items():
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                ip.run_line_magic("pagedkv", f"load --device cpu --kv-cache-memory {args.kv_cache_memory}{flag}")
                r = run_pair(ip, rep, args.first_tokens, session)
            results[name].append(r)
            print(f"  rep {rep + 1} {name:16s}: turn-2 TTFT {r['ttft'] * 1e3:7.1f} ms, "
                  f"{r['cached']:4d}/{r['prompt']} prompt tokens cached")
    with contextlib.redirect_stdout(io.StringIO()):
        ip.run_line_magic("pagedkv", "unload")
    on = statistics.median(r["ttft"] for r in results["prefix cache on"])
    off = statistics.median(r["ttft"] for r in results["prefix cache off"])
    prompt = results["prefix cache on"][0]["prompt"]
    cached = results["prefix cache on"][0]["cached"]
    print(f"\nsecond %%chat turn ({prompt} prompt tokens, {cached} of them from turn 1's blocks):")
    print(f"  TTFT median, prefix cache on : {on * 1e3:7.1f} ms")
    print(f"  TTFT median, prefix cache off: {off * 1e3:7.1f} ms")
    print(f"  ratio on/off: {on / off:.3f} (target <= 0.3)")
    return 0 if on / off <= 0.3 else 1


if __name__ == "__main__":
    import sys
    raise SystemExit(main(sys.argv[1:]))
