"""`python -m jupyter_pagedkv.bench monitor`: what a live monitor costs.

1. Overhead: the 32-request chat workload on the embedded model, generated through the background
   stepping thread as in a notebook, with monitors (the anywidget, whose state is serialised as
   for a kernel, plus a comm subscriber that encodes every frame as the side panel receives it)
   switched on and off every second; adjacent on/off stretches are compared (see `interleaved`).
   `--rounds N` also times whole runs with and without monitors, alternating ABBA (medians).
2. Cost per update at 100,000 blocks: a tiny model (the cost does not depend on the weights)
   with a 100,000-block pool, ~40% of it cached prefixes, then 128 requests decoding while the
   feed publishes at 10 Hz from its own thread; the time of each publish (snapshot of the changed
   blocks + diff + gauges + sending) is recorded by the feed.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ..sim.workload import chat_requests


class CommLike:
    """Encodes each frame as the side panel's comm would (JSON header + binary buffers)."""

    def __init__(self) -> None:
        self.frames = 0
        self.bytes = 0

    def __call__(self, frame) -> None:
        if frame is None:
            return
        data, buffers = frame.to_message()
        self.frames += 1
        self.bytes += len(json.dumps(data)) + sum(len(b) for b in buffers)


def _started_engine(kv_cache_memory: str, max_tokens: int):
    """The embedded model stepping in its background thread, warmed up, and the 32-request workload."""
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine

    engine = Engine.from_pretrained(kv_cache_memory=kv_cache_memory, max_num_seqs=64)
    work = chat_requests(32, min_tokens=min(16, max_tokens), max_tokens=max_tokens)
    prompts = [engine.apply_chat_template(r.messages) for r in work]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in work]
    engine.start()
    engine.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2)     # warm-up
    return engine, work, prompts, params


def overhead(rounds: int, kv_cache_memory: str, max_tokens: int) -> dict:
    engine, work, prompts, params = _started_engine(kv_cache_memory, max_tokens)
    try:
        import anywidget  # noqa: F401
        has_widget = True
    except ImportError:
        has_widget = False
    times: dict[str, list[float]] = {"off": [], "on": []}
    sent = {"frames": 0, "bytes": 0, "publish_s": 0.0}
    order = []
    for r in range(rounds):
        order += ["off", "on"] if r % 2 == 0 else ["on", "off"]
    for mode in order:
        engine.reset_prefix_cache()
        comm, widget, token = CommLike(), None, None
        feed = engine.monitor_feed
        publish_before = sum(feed.publish_times), len(feed.publish_times)
        if mode == "on":
            widget = engine.monitor() if has_widget else None
            token = feed.subscribe(comm)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        if mode == "on":
            time.sleep(0.3)                         # the trailing frame
            feed.unsubscribe(token)
            if widget is not None:
                widget.close()
            sent["frames"] += comm.frames
            sent["bytes"] += comm.bytes
            sent["publish_s"] += sum(feed.publish_times) - publish_before[0]
        assert sum(len(o.token_ids) for o in outs) == sum(r.max_tokens for r in work)
        times[mode].append(elapsed)
        print(f"  {mode:>3}: {elapsed:6.2f} s", flush=True)
    engine.check_invariants()
    tokens = sum(r.max_tokens for r in work)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    engine.shutdown()
    return {"tokens": tokens, "off_s": off, "on_s": on, "overhead": on / off - 1, "rounds": times,
            "widget": has_widget, "frames": sent["frames"] // rounds,
            "bytes_per_frame": sent["bytes"] / max(1, sent["frames"]),
            "publish_s_per_run": sent["publish_s"] / rounds}


def interleaved(kv_cache_memory: str, max_tokens: int, period: float) -> dict:
    """One 32-request generation with the monitors switched on and off every `period` seconds.

    Load from other jobs drifts over minutes, so whole runs compared one after another measure
    mostly that drift; here each "on" stretch is compared with the "off" stretch right after it,
    whose batch (running requests, context lengths) is nearly the same. The figure is the median
    over those pairs of (mean step interval on) / (mean step interval off), where a step
    interval is the time from the end of one step to the end of the next: it includes any wait
    for the engine lock or the GIL that the monitor causes."""
    import threading

    engine, work, prompts, params = _started_engine(kv_cache_memory, max_tokens)
    widget = engine.monitor()
    feed = engine.monitor_feed
    feed.unsubscribe(widget._token)               # switched on and off below
    comm = CommLike()
    state = {"on": False}
    ends: list[tuple[float, bool]] = []
    engine.add_step_listener(lambda: ends.append((time.perf_counter(), state["on"])))
    done = threading.Event()

    def toggle() -> None:
        tokens: list[int] = []
        while not done.wait(period):
            if state["on"]:
                for t in tokens:
                    feed.unsubscribe(t)
                tokens.clear()
            else:
                tokens[:] = [feed.subscribe(widget._receive), feed.subscribe(comm)]
            state["on"] = not state["on"]
        for t in tokens:
            feed.unsubscribe(t)

    switcher = threading.Thread(target=toggle, daemon=True)
    switcher.start()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    done.set()
    switcher.join()
    assert sum(len(o.token_ids) for o in outs) == sum(r.max_tokens for r in work)
    # Group consecutive step intervals by the state at the step's end, then pair each "on"
    # stretch with the "off" stretch that follows it.
    stretches: list[tuple[bool, list[float]]] = []
    for (t_prev, _), (t, on) in zip(ends, ends[1:]):
        if not stretches or stretches[-1][0] != on:
            stretches.append((on, []))
        stretches[-1][1].append(t - t_prev)
    ratios = [statistics.mean(a) / statistics.mean(b) for (on_a, a), (on_b, b) in zip(stretches, stretches[1:])
              if on_a and not on_b]
    engine.check_invariants()
    engine.shutdown()
    return {"tokens": sum(r.max_tokens for r in work), "elapsed_s": elapsed, "pairs": len(ratios),
            "steps": len(ends), "overhead": statistics.median(ratios) - 1 if ratios else float("nan"),
            "frames": comm.frames, "bytes_per_frame": comm.bytes / max(1, comm.frames),
            "publish_s": sum(feed.publish_times)}


def per_update(num_blocks: int, seconds: float) -> dict:
    import transformers as tf

    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    model = tf.LlamaForCausalLM(cfg).eval()
    engine = Engine(model, None, num_blocks=num_blocks, block_size=16, max_num_seqs=128,
                    max_num_batched_tokens=8192)
    rng = random.Random(0)
    # ~40% of the pool becomes cached prefixes (prompts of 2,048 random tokens, one new token each).
    fill = int(num_blocks * 0.4) // 128
    engine.generate([[rng.randrange(3, 512) for _ in range(2048)] for _ in range(fill)],
                    SamplingParams(max_tokens=1, ignore_eos=True))
    feed = engine.monitor_feed
    comm = CommLike()
    sizes: list[int] = []

    def receive(frame) -> None:
        comm(frame)
        if frame is not None and not frame.full:
            sizes.append(len(frame.ids))

    t0 = time.perf_counter()
    token = feed.subscribe(receive)                 # the first, full frame
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = feed.publish(full_scan=True)             # what the periodic resync costs
    resync_s = time.perf_counter() - t0
    feed.publish_times.clear()
    feed.lock_wait_times.clear()
    sizes.clear()
    engine.start()
    ids = [engine.add_request([rng.randrange(3, 512) for _ in range(rng.randint(200, 1500))],
                              SamplingParams(max_tokens=400, ignore_eos=True)) for _ in range(128)]
    time.sleep(seconds)
    times = sorted(feed.publish_times)
    waits = sorted(feed.lock_wait_times)
    for rid in ids:
        engine.abort(rid)
    feed.unsubscribe(token)
    engine.stop()
    engine.check_invariants()
    stats = engine.stats()
    return {"num_blocks": num_blocks, "first_full_s": first_s, "resync_s": resync_s,
            "updates": len(times), "median_s": statistics.median(times) if times else float("nan"),
            "p90_s": times[int(0.9 * (len(times) - 1))] if times else float("nan"),
            "max_s": times[-1] if times else float("nan"), "steps": engine.num_steps,
            "wait_median_s": statistics.median(waits) if waits else float("nan"),
            "median_changed": statistics.median(sizes) if sizes else 0, "max_changed": max(sizes, default=0),
            "cached_blocks": stats.num_cached, "full_changed": len(full.ids) if full else 0}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench monitor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--period", type=float, default=1.0,
                    help="seconds between switching the monitors on and off in the interleaved run")
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time whole runs with and without monitors, N each, ABBA (0: skip)")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="longest request of the 32 (seeded in [16, N]; 128 = the throughput workload)")
    ap.add_argument("--num-blocks", type=int, default=100_000, help="pool size for the per-update cost")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to sample updates")
    ap.add_argument("--skip-overhead", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 0 or args.period <= 0 or args.num_blocks < 1 or args.seconds <= 0 or args.max_tokens < 1:
        ap.error("--rounds, --num-blocks, --seconds and --max-tokens must be positive")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_overhead:
        print(f"1. monitor overhead, interleaved: 32 chat requests (max_tokens 16-{args.max_tokens}), "
              f"embedded model, monitors (anywidget + comm subscriber) on/off every {args.period:g} s")
        i = interleaved(args.kv_cache_memory, args.max_tokens, args.period)
        print(f"   {i['tokens']} tokens in {i['elapsed_s']:.1f} s ({i['tokens'] / i['elapsed_s']:.1f} tok/s), "
              f"{i['steps']} steps, {i['pairs']} on/off pairs: step interval with monitors / without, "
              f"median {1 + i['overhead']:.3f} = overhead {i['overhead']:+.1%} (target <= 5%)")
        print(f"   {i['frames']} frames while on, {i['bytes_per_frame']:.0f} bytes per frame; feed thread "
              f"busy {i['publish_s']:.2f} s in all ({i['publish_s'] / i['elapsed_s']:.2%} of the run)")
    if not args.skip_overhead and args.rounds:
        print(f"1b. monitor overhead: 32 chat requests (max_tokens 16-{args.max_tokens}), embedded model, "
              f"{args.rounds} rounds (ABBA)")
        o = overhead(args.rounds, args.kv_cache_memory, args.max_tokens)
        print(f"   {o['tokens']} tokens; median without monitor {o['off_s']:.2f} s "
              f"({o['tokens'] / o['off_s']:.1f} tok/s), with monitor {o['on_s']:.2f} s "
              f"({o['tokens'] / o['on_s']:.1f} tok/s): overhead {o['overhead']:+.1%} (target <= 5%)")
        print(f"   monitors: {'anywidget + ' if o['widget'] else ''}comm subscriber; {o['frames']} frames "
              f"per run, {o['bytes_per_frame']:.0f} bytes per frame, feed thread busy "
              f"{o['publish_s_per_run']:.2f} s per run ({o['publish_s_per_run'] / o['on_s']:.2%} of the run)")
    print(f"2. cost per update at {args.num_blocks:,} blocks (tiny model, 128 requests decoding, "
          f"{args.seconds:.0f} s)")
    u = per_update(args.num_blocks, args.seconds)
    print(f"   {u['updates']} updates over {u['steps']} engine steps; changed blocks per update: median "
          f"{u['median_changed']:.0f}, max {u['max_changed']}; {u['cached_blocks']:,} cached blocks")
    print(f"   snapshot + diff + gauges + encode per update: median {u['median_s'] * 1e3:.2f} ms, "
          f"p90 {u['p90_s'] * 1e3:.2f} ms, max {u['max_s'] * 1e3:.2f} ms (target < 5 ms); waiting for "
          f"the step in progress to release the engine lock: median {u['wait_median_s'] * 1e3:.1f} ms")
    print(f"   first full frame to a new monitor {u['first_full_s'] * 1e3:.1f} ms; full resync scan "
          f"(every 5 s of activity) {u['resync_s'] * 1e3:.1f} ms")
    return 0
