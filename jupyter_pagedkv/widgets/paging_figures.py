"""paging_figures: still pictures that teach paging, captured from a real engine run.

`pool_figure` shows which blocks are held; a reader learning PagedAttention also needs to see why:
which logical block of which sequence lives in which physical block, how full each block is, who
shares it, and what the contiguous baseline wastes instead. Every picture here is drawn from a
`PagingFrame` (`frames.py`) read off an engine between two steps, never drawn by hand.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from .frames import FrameAt, PagingFrame, SeqTable, capture
from .pool_figure import FONT, _MarkedSquare, cue_colours, state_colours

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

STAGES = ("allocate", "grow", "fork", "copy-on-write", "cache hit", "preempt", "free")
EMPTY_HATCH = "////"            # reserved but not filled: the contiguous baseline's waste
INK = (0.15, 0.15, 0.15)
__all__ = ["EMPTY_HATCH", "FONT", "INK", "STAGES", "FrameAt", "PagingFrame", "SeqTable", "block_table_figure",
           "capture", "contiguous_demo", "contiguous_figure", "paging_story", "story_figure", "toy_engine"]


# -- drawing -----------------------------------------------------------------------------------------
def _colour(state: str) -> tuple[float, float, float]:
    return state_colours().get(state, (0.4, 0.4, 0.4))


def _style(ax: Axes) -> None:
    ax.tick_params(labelsize=FONT, length=2)
    for side in ax.spines.values():
        side.set_visible(False)


def _legend_handles(states: Sequence[str], contiguous: bool = False) -> tuple[list, dict]:
    """Legend entries for the states shown plus the slot cues, and the shared mark's handler."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_colour(s), edgecolor=INK, lw=0.5, label=s)
               for s in ("free", "cached", "used", "shared") if s in states or s in ("free", "used")]
    handles.append(Patch(facecolor="white", edgecolor=_colour("used"), hatch=EMPTY_HATCH if contiguous else None,
                         label="reserved, empty" if contiguous else "empty slot"))
    return handles, {h: _MarkedSquare() for h in handles if h.get_label() == "shared"}


def _block_row(ax: Axes, x: float, y: float, fill: int, size: int, state: str, gid: str,
               h: float = 0.8, hatch_empty: bool = False) -> None:
    """`size` slot cells from (x, y) rightwards: the first `fill` solid, the rest empty."""
    from matplotlib.patches import Rectangle

    colour = _colour(state)
    edge = (0.7, 0.7, 0.7) if state == "free" else colour
    for k in range(size):
        solid = k < fill
        ax.add_patch(Rectangle((x + k + 0.06, y - h / 2), 0.88, h, lw=1,
                               facecolor=colour if solid or state == "free" else "white", edgecolor=edge,
                               hatch=EMPTY_HATCH if hatch_empty and not solid else None,
                               gid=f"{gid}:{'filled' if solid else 'empty'}"))


def _mark(ax: Axes, x: float, y: float, h: float, gid: str) -> None:
    from matplotlib.patches import Polygon

    ax.add_patch(Polygon([(x, y - h / 2), (x + 0.45, y - h / 2), (x, y)], closed=True, lw=0,
                         facecolor=cue_colours()["MARK"], gid=gid))


def _draw_paged(frame: PagingFrame, ax_t: Axes, ax_p: Axes, max_entries: int, max_rows: int,
                tag: str = "") -> int:
    """Block tables in `ax_t`, the physical pool in `ax_p`, an arrow per table entry; returns the
    number of arrows drawn."""
    from matplotlib.patches import ConnectionPatch, Rectangle

    bs, n = frame.block_size, frame.num_blocks
    fill, refs = frame.block_fill(), frame.ref_counts
    # The pool: one row of slots per physical block, block 0 on top.
    for b, state in enumerate(frame.states):
        _block_row(ax_p, 0, b, fill[b], bs, state, f"phys{tag}:{b}")
        if state == "shared":
            _mark(ax_p, 0.06, b, 0.8, f"mark{tag}:{b}")
    ax_p.set(xlim=(-0.1, bs + 0.1), ylim=(n - 0.5, -0.5), xticks=[k + 0.5 for k in range(bs)], yticks=range(n))
    ax_p.set_xticklabels([str(k) for k in range(bs)])
    ax_p.set_xlabel("slot in block (token)", fontsize=FONT)
    # Ids (with a shared block's ref count) on the right: arrows arrive from the left and cross no
    # text, and tick labels are laid out outside the data, so they can never cover a block.
    ax_p.set_yticklabels([f"{b}  ref {refs[b]}" if s == "shared" else str(b) for b, s in enumerate(frame.states)])
    ax_p.yaxis.tick_right()
    ax_p.yaxis.set_label_position("right")
    ax_p.set_ylabel("physical block id", fontsize=FONT)
    ax_p.set_facecolor("none")          # arrow heads drawn with the tables stay visible here
    _style(ax_p)
    # The tables: one row per sequence, one cell per logical block, as full as that block is.
    pitch = max(1.0, min(2.0, n / max(1, max_rows)))
    arrows = 0
    if not frame.tables:
        ax_t.text(0.1, 0.5, "no live sequence", fontsize=FONT, va="center", color=INK)
    for j, t in enumerate(frame.tables):
        y = j * pitch + 0.5
        if not t.block_ids:
            ax_t.text(0.1, y, f"{t.state}: holds no block", fontsize=FONT, va="center", color=INK)
        for i, b in enumerate(t.block_ids):
            part = t.fill(i, bs)
            state = frame.states[b]
            ax_t.add_patch(Rectangle((i + 0.05, y - 0.4), 0.9, 0.8, lw=1, facecolor="white",
                                     edgecolor=_colour(state), gid=f"entry{tag}:{t.label}:{i}"))
            if part:
                ax_t.add_patch(Rectangle((i + 0.05, y - 0.4), 0.9 * part / bs, 0.8, lw=0,
                                         facecolor=_colour(state), gid=f"entryfill{tag}:{t.label}:{i}:{part}"))
            if state == "shared":
                _mark(ax_t, i + 0.05, y, 0.8, f"entrymark{tag}:{t.label}:{i}")
            ax_t.text(i + 0.5, y, str(b), fontsize=FONT, ha="center", va="center", color=INK,
                      bbox=dict(boxstyle="round,pad=0.12", fc="white", ec="none", alpha=0.85))
            arrow = ConnectionPatch((i + 0.95, y), (0, b), coordsA=ax_t.transData, coordsB=ax_p.transData,
                                    axesA=ax_t, axesB=ax_p, arrowstyle="-|>", mutation_scale=7, lw=0.7,
                                    color=INK, alpha=0.55, shrinkA=1, shrinkB=1, zorder=0.5, clip_on=False)
            arrow.set_gid(f"arrow{tag}:{t.label}:{i}")
            ax_t.add_artist(arrow)      # under the table's cells: an arrow never hides an entry
            arrows += 1
    rows = [j * pitch + 0.5 for j in range(len(frame.tables))]
    ax_t.set(xlim=(0, max(max_entries, 1) + 0.1), ylim=(max(n * 1.0, max_rows * pitch), 0),
             xticks=[i + 0.5 for i in range(max_entries)], yticks=rows)
    ax_t.set_xticklabels([str(i) for i in range(max_entries)])
    ax_t.set_yticklabels([t.label for t in frame.tables])
    ax_t.set_xlabel(f"logical block index ({bs} tokens each)", fontsize=FONT)
    ax_t.set_ylabel("sequence (request #sample)", fontsize=FONT)
    _style(ax_t)
    return arrows


def block_table_figure(frame: PagingFrame | Any, title: str | None = None) -> Figure:
    """Each live sequence's block table (left) beside the physical pool (right), with an arrow
    from every table entry to the block it names: the picture of what paging means. `frame` may
    also be an idle engine, captured now."""
    import matplotlib.pyplot as plt

    frame = frame if isinstance(frame, PagingFrame) else capture(frame)
    entries = max((len(t.block_ids) for t in frame.tables), default=1)
    fig = plt.figure(figsize=(8, 0.24 * frame.num_blocks + 1.9))
    height = fig.get_figheight()
    grid = fig.add_gridspec(1, 2, width_ratios=[max(entries, 4), frame.block_size + 0.2], wspace=0.25,
                            left=0.12, right=0.86, top=1 - 0.55 / height, bottom=0.85 / height)
    ax_t, ax_p = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    _draw_paged(frame, ax_t, ax_p, entries, len(frame.tables))
    handles, handler = _legend_handles(frame.states)
    fig.legend(handles=handles, handler_map=handler, loc="lower center", ncol=len(handles),
               fontsize=FONT, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(title or f"{frame.stage or 'block tables'} (step {frame.step}): {frame.note}".rstrip(": "),
                 fontsize=9)
    return fig


def contiguous_figure(frame: PagingFrame | Any, title: str | None = None) -> Figure:
    """The contiguous baseline in the same visual language: the arena as one row of token slots,
    each request's reservation a run of them (stored tokens solid, reserved-but-empty hatched),
    and the free holes between reservations labelled with their length. `frame` may also be an
    idle engine built with `allocator="contiguous"`, captured now."""
    import matplotlib.pyplot as plt

    frame = frame if isinstance(frame, PagingFrame) else capture(frame)
    bs, n = frame.block_size, frame.num_blocks
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(frame.tables) + 2.2))
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.14, right=0.98, top=1 - 0.5 / height, bottom=0.85 / height)
    rows = list(frame.tables) + [None]                 # None: the whole arena, holes included
    owner = {}
    for t in frame.tables:
        for i, b in enumerate(t.block_ids):
            owner[b] = (t, i)
    for j, t in enumerate(rows):
        for b in range(n):
            held = owner.get(b)
            if t is not None and (held is None or held[0] is not t):
                continue
            if held is None:
                _block_row(ax, b * bs, j, 0, bs, "free", f"hole:{b}", h=0.7)
                continue
            part = held[0].fill(held[1], bs)
            _block_row(ax, b * bs, j, part, bs, frame.states[b], f"res:{held[0].label}:{b}", h=0.7,
                       hatch_empty=True)
        if t is not None and not t.block_ids:
            ax.text(0.5, j, f"{t.state}: no reservation", fontsize=FONT, va="center", color=INK)
    arena = len(rows) - 1
    for start, length in _holes(frame):
        ax.text((start + length / 2) * bs, arena + 0.55, f"hole: {length} block{'s' * (length > 1)}",
                fontsize=FONT, ha="center", va="top", color=INK, gid=f"holelabel:{start}",
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none"))
    for b in range(n + 1):
        ax.axvline(b * bs, color=(0.35, 0.35, 0.35), lw=0.8, zorder=0)
    ax.set(xlim=(0, n * bs), ylim=(arena + 1.0, -0.6), yticks=range(len(rows)),
           xticks=range(0, n * bs + 1, bs))
    ax.set_yticklabels([t.label for t in frame.tables] + ["whole arena"])
    ax.set_xlabel(f"arena position (token slots; {bs} per block)", fontsize=FONT)
    ax.set_ylabel("reservation", fontsize=FONT)
    _style(ax)
    handles, handler = _legend_handles(frame.states, contiguous=True)
    fig.legend(handles=handles, handler_map=handler, loc="lower center", ncol=len(handles), fontsize=FONT,
               frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(title or f"contiguous arena (step {frame.step}): {frame.note}".rstrip(": "), fontsize=9)
    return fig


def _holes(frame: PagingFrame) -> list[tuple[int, int]]:
    """Maximal runs of blocks no table holds: (first block, length)."""
    held = {b for t in frame.tables for b in t.block_ids}
    runs: list[tuple[int, int]] = []
    for b in range(frame.num_blocks):
        if b in held:
            continue
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def story_figure(frames: Sequence[PagingFrame], columns: int = 2) -> Figure:
    """Small multiples, one panel per frame (table + pool + arrows) on shared scales, titled with
    its stage, so the eye follows one pool through the whole story."""
    import matplotlib.pyplot as plt

    if not frames:
        raise ValueError("no frames to draw: pass the frames of paging_story()")
    entries = max(max((len(t.block_ids) for t in f.tables), default=1) for f in frames)
    rows_max = max(max(len(f.tables) for f in frames), 1)
    cells = len(frames) + 1                           # one cell more, for the legend
    nrows = -(-cells // columns)
    n = frames[0].num_blocks
    fig = plt.figure(figsize=(6.2 * columns, nrows * (0.2 * n + 1.6)))
    outer = fig.add_gridspec(nrows, columns, hspace=0.62, wspace=0.42, left=0.08,
                             right=1 - 0.95 / fig.get_figwidth(),
                             top=1 - 0.5 / fig.get_figheight(), bottom=0.45 / fig.get_figheight())
    for k, frame in enumerate(frames):
        inner = outer[k // columns, k % columns].subgridspec(
            1, 2, width_ratios=[max(entries, 4), frame.block_size + 0.2], wspace=0.35)
        ax_t, ax_p = fig.add_subplot(inner[0]), fig.add_subplot(inner[1])
        _draw_paged(frame, ax_t, ax_p, entries, rows_max, tag=f"@{k}")
        ax_t.set_title(f"{k + 1}. {frame.stage} (step {frame.step})\n{frame.note}", fontsize=9, loc="left")
    spare = fig.add_subplot(outer[(cells - 1) // columns, (cells - 1) % columns])
    spare.axis("off")
    handles, handler = _legend_handles([s for f in frames for s in f.states])
    spare.legend(handles=handles, handler_map=handler, loc="center", fontsize=FONT, frameon=False,
                 title="block state (solid slots hold KV)", title_fontsize=FONT)
    return fig


# -- the toy run -------------------------------------------------------------------------------------
TOY_BLOCKS, TOY_BLOCK_SIZE = 12, 4


def toy_engine(allocator: str = "paged", seed: int = 0) -> Any:
    """A 12 x 4-token pool over a tiny random Llama (CPU, fp32): big enough for every event of
    paging to happen for real, small enough to read block by block."""
    import torch
    import transformers as tf

    from ..engine.engine import Engine

    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = tf.LlamaForCausalLM(config).eval()
    return Engine(model, None, name="toy-llama", block_size=TOY_BLOCK_SIZE, num_blocks=TOY_BLOCKS,
                  allocator=allocator, seed=seed)


def _check_toy(engine: Any, allocator: str) -> None:
    """The story's events are timed for this pool: refuse any other rather than draw a different one."""
    info = engine.info()
    if ((info.num_blocks, info.block_size) != (TOY_BLOCKS, TOY_BLOCK_SIZE) or engine.has_unfinished_requests()
            or engine.is_running or getattr(getattr(engine, "config", None), "allocator", "paged") != allocator
            or (allocator == "paged" and not info.prefix_caching)):
        raise ValueError(f"this run needs an idle, stopped {allocator} engine of {TOY_BLOCKS} blocks x "
                         f"{TOY_BLOCK_SIZE} tokens{' with prefix caching' * (allocator == 'paged')} "
                         f"(toy_engine({allocator!r}) builds one), got {info.num_blocks} x {info.block_size}")


def _step_until(engine: Any, done, what: str, limit: int = 60) -> None:
    for _ in range(limit):
        engine.step()
        if done():
            return
        if not engine.has_unfinished_requests():
            break
    raise RuntimeError(f"the toy run never reached {what}")


def _tables(engine: Any, request_id: str) -> list[SeqTable]:
    return [t for t in capture(engine).tables if t.request_id == request_id]


def paging_story(engine: Any = None) -> list[PagingFrame]:
    """Run three requests through a 12 x 4 pool and capture a frame at each event of STAGES, each
    the first step at which the engine shows it: allocate, grow, fork (n=2), copy-on-write, prefix
    cache hit, preemption under pool pressure, and the pool after everything is freed."""
    from ..core.sampling_params import SamplingParams

    engine = engine if engine is not None else toy_engine()
    _check_toy(engine, "paged")
    bs, frames = TOY_BLOCK_SIZE, []
    prompt_a, prompt_b = list(range(10, 20)), list(range(40, 46))

    def shot(stage: str, note: str) -> PagingFrame:
        frames.append(capture(engine, stage, note))
        return frames[-1]

    engine.add_request(prompt_a, SamplingParams(max_tokens=26, temperature=0, ignore_eos=True), "A")
    _step_until(engine, lambda: bool(_tables(engine, "A")[0].block_ids), "A's admission")
    a = _tables(engine, "A")[0]
    shot("allocate", f"A's {len(prompt_a)}-token prompt takes {len(a.block_ids)} blocks, "
                     f"the last {a.fill(len(a.block_ids) - 1, bs)}/{bs} full")
    first = len(a.block_ids)
    _step_until(engine, lambda: len(_tables(engine, "A")[0].block_ids) > first, "A's growth")
    a = _tables(engine, "A")[0]
    shot("grow", f"A's token {a.num_tokens} opens a new block ({a.block_ids[-1]})")
    engine.add_request(prompt_b, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True), "B")
    _step_until(engine, lambda: len(_tables(engine, "B")) == 2, "B's fork")
    b0, b1 = _tables(engine, "B")
    shot("fork", f"B's 2 samples share its {len(b0.block_ids)} prompt blocks (ref 2)")
    last = b0.block_ids[-1]
    _step_until(engine, lambda: len({t.block_ids[-1] for t in _tables(engine, "B")}) == 2, "copy-on-write")
    copier = next(t for t in _tables(engine, "B") if t.block_ids[-1] != last)
    shot("copy-on-write", f"{copier.label} wrote into shared, part-full block {last}: "
                          f"it gets copy {copier.block_ids[-1]}")
    engine.add_request(prompt_a, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), "C")
    hit = lambda: next((r.cached_tokens or 0 for r in engine.request_rows() if r.request_id == "C"), 0)
    _step_until(engine, lambda: hit() > 0, "a prefix-cache hit")
    c = _tables(engine, "C")[0]
    shot("cache hit", f"C repeats A's prompt: {hit()} of {len(prompt_a)} tokens hit A's "
                      f"cached blocks {', '.join(map(str, c.block_ids[:hit() // bs]))}")
    _step_until(engine, lambda: engine.stats().num_preemptions > 0, "a preemption")
    gone = [t.label for t in capture(engine).tables if t.state in ("preempted", "swapped")]
    who = "it" if len(gone) == 1 else "they"
    # The shot is taken once the victim has given its blocks back, so say so: its former blocks
    # are drawn free, not the full pool that forced the preemption.
    shot("preempt", f"pool ran dry: {', '.join(gone)} preempted; drawn after {who} freed "
                    f"{'its' if who == 'it' else 'their'} blocks (to recompute later)")
    _step_until(engine, lambda: not engine.has_unfinished_requests(), "the end of the run")
    s = engine.stats()
    shot("free", f"all done: {s.num_cached} full blocks stay cached (ref 0), {s.num_free} free")
    return frames


def contiguous_demo(engine: Any = None) -> PagingFrame:
    """The same pool under the contiguous baseline (`allocator="contiguous"`): three requests
    reserve prompt + max_tokens each; the short one finishes and leaves a hole; a fourth request
    then waits although enough blocks are free in total (external fragmentation). Returns the
    frame of that moment; the run is then finished, so the engine ends empty."""
    from ..core.sampling_params import SamplingParams

    engine = engine if engine is not None else toy_engine("contiguous")
    _check_toy(engine, "contiguous")
    # (id, prompt tokens, max_tokens): A, B, C fill 3 + 2 + 5 blocks; D wants 3 once B has gone.
    plan = (("A", 5, 7), ("B", 3, 3), ("C", 6, 14), ("D", 4, 8))
    params = {rid: SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for rid, _, m in plan}
    for k, (rid, prompt, _) in enumerate(plan[:3]):
        engine.add_request(list(range(20 + 20 * k, 20 + 20 * k + prompt)), params[rid], rid)
    live = lambda: {t.request_id for t in capture(engine).tables}
    _step_until(engine, lambda: "B" not in live(), "B's end")
    engine.add_request(list(range(80, 80 + plan[3][1])), params["D"], "D")
    engine.step()
    frame, stats = capture(engine, "contiguous", ""), engine.stats()
    if any(t.block_ids for t in frame.tables if t.request_id == "D"):
        raise RuntimeError("D found room: the toy run no longer shows external fragmentation")
    need = -(-(plan[3][1] + plan[3][2]) // TOY_BLOCK_SIZE)
    holes = _holes(frame)
    note = (f"{stats.tokens_stored} of {stats.slots_allocated} reserved slots hold KV; "
            f"{sum(n for _, n in holes)} blocks free, largest hole {max((n for _, n in holes), default=0)}: "
            f"D needs {need} in a row and waits")
    _step_until(engine, lambda: not engine.has_unfinished_requests(), "the end of the run")
    return replace(frame, note=note)
