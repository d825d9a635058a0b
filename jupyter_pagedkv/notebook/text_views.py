"""Text views of the engine for `%pagedkv requests` and `%pagedkv monitor`: a request table and
a block map, plain text so they read the same in a terminal, a notebook and a log."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .session import KernelSession

if TYPE_CHECKING:
    from ..protocol import EngineClient


def requests_table(session: KernelSession, engine: EngineClient) -> str:
    """Live requests, then the last finished ones; chat sessions and background jobs below."""
    found = engine.request_rows()
    tenants = any(r.tenant is not None for r in found)      # a column only once someone names one
    rows = [("id", "source", *(("tenant",) if tenants else ()), "state", "prompt", "output", "blocks",
             "cached", "TTFT")]
    for r in found:
        state = f"done ({r.finish_reason})" if r.state == "done" else r.state
        rows.append((r.request_id, session.origins.get(r.request_id, "python"),
                     *((r.tenant or "-",) if tenants else ()), state,
                     str(r.prompt_tokens), str(r.output_tokens), str(r.blocks),
                     "-" if r.cached_tokens is None else str(r.cached_tokens),
                     "-" if r.ttft is None else f"{r.ttft * 1e3:.0f} ms"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(rows) == 1:
        lines.append("(no requests yet)")
    if session.chats:
        lines.append("")
        lines.append("chat sessions:")
        for chat in session.chats.values():
            last = chat.outputs[-1].request_id if chat.outputs else "-"
            lines.append(f"  {chat.name}: {chat.num_turns} turn{'s' if chat.num_turns != 1 else ''}, "
                         f"{len(chat.token_ids)} tokens of conversation, last request {last}")
    live = session.live_jobs()
    if session.jobs:
        lines.append("")
        lines.append(f"background jobs: {len(live)} running, {len(session.jobs) - len(live)} done")
    return "\n".join(lines)


def block_map(snapshot: dict, width: int = 64, max_chars: int = 512) -> str:
    """The pool as text, `width` characters per line: one per block, or per group of blocks when
    the pool is larger than `max_chars` (a group shows its busiest state: shared > used > cached)."""
    symbol = {"free": ".", "cached": "c", "used": "u", "shared": "s"}
    rank = {"free": 0, "cached": 1, "used": 2, "shared": 3}
    states = snapshot["states"]
    group = max(1, -(-len(states) // max_chars))
    # States added later (swapped, speculative, ...) show as their first letter, ranked as used.
    chars = "".join(symbol.get(s := max(states[i:i + group], key=lambda x: rank.get(x, 2)), s[0])
                    for i in range(0, len(states), group))
    lines = [chars[i:i + width] for i in range(0, len(chars), width)]
    scale = "one character per block" if group == 1 else f"one character per {group} blocks"
    lines.append(f"legend ({scale}): . free  c cached (reusable prefix)  u used  s shared")
    return "\n".join(lines)

