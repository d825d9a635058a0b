"""`%pagedkv tenants` and `%pagedkv tenant NAME ...`: the per-tenant table, and setting a tenant's
weight and cap, as text the magics print (no IPython here, so a terminal can use them too)."""
from __future__ import annotations

import argparse
import shlex

USAGE = "usage: %pagedkv tenant NAME [--weight W] [--max-blocks N]"


def tenants_table(stats) -> str:
    """`%pagedkv tenants`: one row per tenant (EngineStats.tenants), policy and pool on top."""
    if not stats.tenants:
        return ("no tenants yet: name one per request (%%generate --tenant NAME, engine.generate(..., "
                "tenant=NAME)) or set one (%pagedkv tenant NAME --weight W --max-blocks N)")
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"
    rows = [("tenant", "weight", "cap", "share", "blocks", "shared", "cached tok", "running", "waiting",
             "preempted", "finished", "TTFT p50", "TTFT tail", "e2e tail", "tok/s")]
    for t in stats.tenants.values():
        tail = f" ({t.tail_name})" if t.ttft_p99 is not None else ""
        rows.append((t.name, f"{t.weight:g}", "-" if t.max_blocks is None else str(t.max_blocks),
                     f"{t.share:.0f}", str(t.blocks_used), str(t.blocks_shared), str(t.cached_tokens),
                     str(t.num_running), str(t.num_waiting), str(t.num_preempted), str(t.num_finished),
                     ms(t.ttft_p50), ms(t.ttft_p99) + tail,
                     "-" if t.e2e_p99 is None else f"{t.e2e_p99:.2f} s{tail}", f"{t.tokens_per_s:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"policy: {stats.scheduling_policy}; pool: {stats.num_used} of {stats.num_blocks} blocks in use "
             f"(a block several tenants share counts for each)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def tenant_parser() -> argparse.ArgumentParser:
    """`%pagedkv tenant NAME [--weight W] [--max-blocks N]` (also read by the docs test)."""
    parser = argparse.ArgumentParser(prog="%pagedkv tenant", add_help=False)
    parser.add_argument("name")
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--max-blocks", type=int, default=None)
    return parser


def set_tenant_line(engine, line: str) -> str:
    """Parse `NAME [--weight W] [--max-blocks N]`, apply engine.set_tenant and describe the result;
    ValueError (one line) for a bad line, a bad spec, or an engine that has no tenants."""
    try:
        args = tenant_parser().parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(USAGE) from None
    engine.set_tenant(args.name, weight=args.weight, max_blocks=args.max_blocks)
    stats = engine.stats()
    t = stats.tenants[args.name]
    cap = "no cap" if t.max_blocks is None else f"at most {t.max_blocks} blocks"
    return (f"tenant {args.name}: weight {t.weight:g}, {cap}; holds {t.blocks_used} blocks "
            f"(policy {stats.scheduling_policy})")
