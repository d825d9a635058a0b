"""Streaming a cell's requests into its output: submit together, consume one queue, abort together.

A `CellRun` owns the requests of one cell. The engine's background thread produces StreamDeltas
into one listener queue; the consumer (the cell's main thread, or a watcher thread for
`--background`) folds them into `Panel`s and hands those to a renderer: a display handle updated
in place in a notebook, incremental prints in a terminal, an Output widget for background jobs.
"""
from __future__ import annotations

import contextvars
import html
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from ..protocol import EngineClient
    from ..engine.outputs import RequestOutput, StreamDelta
    from ..core.sampling_params import SamplingParams


logger = logging.getLogger(__name__)

@dataclass
class Panel:
    """What one request has produced so far, as one labelled column of the cell output."""

    request_id: str
    label: str
    text: str = ""
    output: RequestOutput | None = None
    error: BaseException | None = None     # the engine failed this request (not an abort we asked)
    num_samples: int = 1                   # n samples (or beams) of this one request
    kind: str = "sample"                   # the word their labels use: "sample" or "beam"

    @property
    def finished(self) -> bool:
        return self.output is not None

    def sections(self) -> list[tuple[str | None, str]]:
        """(label, text) per sample, so several samples of one prompt read like several prompts:
        one sample has no label; of several, sample 1 streams under "sample 1/N" and the others
        join it, each labelled alike and each its own paragraph, when the request finishes."""
        samples = self.output.outputs if self.output is not None else []
        n = max(self.num_samples, len(samples))
        if n <= 1:
            return [(None, self.text)]
        if len(samples) <= 1:
            return [(f"{self.kind} 1/{n}", self.text)]
        return [(f"{self.kind} {o.index + 1}/{n}", o.text) for o in samples]


def footer(out: RequestOutput) -> str:
    """One line: tokens generated, cached / prompt tokens, TTFT, decode speed, finish reason."""
    m = out.metrics
    n = sum(len(o.token_ids) for o in out.outputs)
    ttft = f"{m.ttft * 1e3:.0f} ms" if m.ttft is not None else "-"
    tpot = m.tpot
    speed = f"{1.0 / tpot:.1f} tok/s" if tpot else "-"
    return (f"[{n} tokens generated · {out.num_cached_tokens}/{len(out.prompt_token_ids)} prompt "
            f"tokens cached · TTFT {ttft} · {speed} · {out.finish_reason}]")


class Renderer(Protocol):
    """Shows a cell's panels. `min_interval` (optional, seconds) is how often it may be asked to
    re-render while streaming; CellRun.wait enforces it, so no renderer throttles on its own."""

    def update(self, panels: Sequence[Panel], final: bool) -> None: ...


@dataclass
class Throttle:
    """At most one render every `interval` seconds, and never a stale last render: text that
    arrived since the last render is still shown once the interval has passed, even when no more
    text follows (a stream that pauses mid-answer, e.g. while a server is busy)."""

    interval: float
    clock: Callable[[], float] = time.monotonic
    last: float = float("-inf")
    dirty: bool = False

    def changed(self) -> None:
        self.dirty = True

    def due(self) -> bool:
        return self.dirty and self.clock() - self.last >= self.interval

    def rendered(self) -> None:
        self.last, self.dirty = self.clock(), False

    def timeout(self) -> float:
        """How long to wait for more input before the pending text is due (the interval if none)."""
        if not self.dirty:
            return self.interval
        return min(self.interval, max(0.001, self.last + self.interval - self.clock()))


class CellRun:
    """The requests of one cell: added with one shared listener, waited on and aborted together."""

    def __init__(self, engine: EngineClient, labels: Sequence[str], tenant: str | None = None,
                 priority: int = 0) -> None:
        self.engine = engine
        self.tenant = tenant
        self.priority = priority
        self.queue: queue.SimpleQueue[StreamDelta] = queue.SimpleQueue()
        self.panels: list[Panel] = []
        self._labels = list(labels)

    @property
    def request_ids(self) -> list[str]:
        return [p.request_id for p in self.panels]

    def submit(self, prompts: Sequence, params: SamplingParams) -> list[str]:
        """Add every prompt, all queued before the engine's next step (`admission()`); if one is
        rejected (ValueError), abort the ones already added."""
        try:
            beams = getattr(params, "beam_width", None)
            n, kind = (beams, "beam") if beams else (getattr(params, "n", 1) or 1, "sample")
            with self.engine.admission():      # the scheduler considers the cell's prompts together
                for prompt, label in zip(prompts, self._labels):
                    rid = self.engine.add_request(prompt, params, priority=self.priority,
                                                  listener=self.queue, tenant=self.tenant)
                    self.panels.append(Panel(rid, label, num_samples=n, kind=kind))
        except BaseException:
            self.abort()
            raise
        return self.request_ids

    def wait(self, render: Renderer, interval: float = 0.1) -> list[RequestOutput]:
        """Fold deltas into panels until every request finished. Renders at most every
        `interval` s (or the renderer's own `min_interval`), at once when a request finishes, and
        always the latest text once it is due, whether or not more arrives (Throttle)."""
        throttle = Throttle(getattr(render, "min_interval", interval))
        while not all(p.finished for p in self.panels):
            try:
                delta = self.queue.get(timeout=throttle.timeout())
            except queue.Empty:
                delta = None
            if delta is not None:
                self._fold(delta)
                throttle.changed()
            if throttle.due() or (delta is not None and delta.finished):
                render.update(self.panels, final=False)
                throttle.rendered()
        render.update(self.panels, final=True)
        return [p.output for p in self.panels]

    def _fold(self, delta: StreamDelta) -> None:
        panel = next(p for p in self.panels if p.request_id == delta.request_id)
        panel.text += delta.text
        if delta.finished:
            panel.output = delta.output
            panel.error = delta.error
            if delta.output is not None and delta.output.outputs:
                # Sample 1 streamed (beams publish only the final, best-first hypotheses); the
                # others share its prompt blocks and are shown beside it (Panel.sections).
                panel.text = delta.output.outputs[0].text

    def abort(self, render: Renderer | None = None) -> int:
        """Abort the unfinished requests of this cell; returns how many were still live.

        The engine publishes an aborted request's last delta inside `abort`, so the final state
        (text so far, finish reason "abort") can be rendered at once."""
        n = sum(1 for rid in self.request_ids if self.engine.abort(rid))
        while True:
            try:
                self._fold(self.queue.get_nowait())
            except queue.Empty:
                break
        if render is not None and all(p.finished for p in self.panels):
            render.update(self.panels, final=True)
        return n


# -- renderers ------------------------------------------------------------------------------------

def plain_body(panel: Panel) -> str:
    """A panel's text as plain text: its samples one after another, each under a `── sample
    i/N ──` line when there are several (the way several prompts are labelled)."""
    return "\n\n".join(f"── {label} ──\n{text}" if label else text for label, text in panel.sections())


def _plain(panels: Sequence[Panel], footers: bool = True) -> str:
    parts = []
    for p in panels:
        head = f"── {p.label} ──\n" if len(panels) > 1 else ""
        tail = f"\n{footer(p.output)}" if footers and p.output is not None else ""
        parts.append(f"{head}{plain_body(p)}{tail}")
    return "\n\n".join(parts)


_HEAD = "<div style='font-weight:600;opacity:.7;margin-bottom:4px'>{}</div>"


def _html(panels: Sequence[Panel]) -> str:
    cols = []
    for p in panels:
        head = _HEAD.format(html.escape(p.label)) if len(panels) > 1 else ""
        body = "".join((_HEAD.format(html.escape(label)) if label else "") + html.escape(text)
                       + ("\n\n" if label else "") for label, text in p.sections()).rstrip("\n")
        body += "" if p.finished else " ▌"
        foot = (f"<div style='opacity:.6;font-size:85%;margin-top:4px'>{html.escape(footer(p.output))}</div>"
                if p.output is not None else "")
        cols.append(f"<div style='flex:1 1 0;min-width:14em'>{head}"
                    f"<div style='white-space:pre-wrap'>{body}</div>{foot}</div>")
    return f"<div style='display:flex;gap:1.5em;align-items:flex-start'>{''.join(cols)}</div>"


def bundle(panels: Sequence[Panel]) -> dict[str, str]:
    return {"text/plain": _plain(panels), "text/html": _html(panels)}


class DisplayRenderer:
    """Notebook: one display output for the cell, updated in place (side-by-side columns)."""

    def __init__(self, display: Callable | None = None) -> None:
        if display is None:
            from IPython.display import display
        self._display = display
        self._handle = None

    def update(self, panels: Sequence[Panel], final: bool) -> None:
        data = bundle(panels)
        if self._handle is None:
            self._handle = self._display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)


class PrintRenderer:
    """Terminal: text as it comes. Several prompts print one after another, each with its label;
    the later ones are generated concurrently and catch up at once when their turn comes."""

    def __init__(self, write: Callable[[str], object] | None = None) -> None:
        self._write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self._current = 0
        self._printed = ""
        self._started = False

    def update(self, panels: Sequence[Panel], final: bool) -> None:
        while self._current < len(panels):
            p = panels[self._current]
            if not self._started:
                if len(panels) > 1:
                    self._write(("\n" if self._current else "") + f"── {p.label} ──\n")
                self._started = True
            body = plain_body(p)
            if not body.startswith(self._printed):    # the final text differs from what streamed
                self._write("\n")
                self._printed = ""
            if body[len(self._printed):]:
                self._write(body[len(self._printed):])
                self._printed = body
            if not p.finished:
                return
            self._write(f"\n{footer(p.output)}\n")
            self._current, self._printed, self._started = self._current + 1, "", False


class WidgetRenderer:
    """Background jobs in a notebook: an ipywidgets Output area the engine fills when it can,
    whichever cell runs at the time (widget state syncs over its comm, not the cell's output).
    `make_bundle` gives the output's data (HTML columns by default; Markdown in markdown format)."""

    def __init__(self, widget, make_bundle: Callable[[Sequence[Panel]], dict[str, str]] | None = None) -> None:
        self.widget = widget
        self.make_bundle = make_bundle or bundle

    def update(self, panels: Sequence[Panel], final: bool) -> None:
        self.widget.outputs = ({"output_type": "display_data", "data": self.make_bundle(panels), "metadata": {}},)


class DonePrinter:
    """Background jobs in a terminal: print the result once, when it is complete."""

    def __init__(self, title: str, write: Callable[[str], object] | None = None) -> None:
        self.title = title
        self._write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))

    def update(self, panels: Sequence[Panel], final: bool) -> None:
        if final:
            self._write(f"\n[{self.title} done]\n{_plain(panels)}\n")


# -- background jobs --------------------------------------------------------------------------------

@dataclass
class BackgroundJob:
    """A `--background` cell: its requests run on the shared engine while later cells execute."""

    run: CellRun
    title: str
    on_done: Callable[[list[RequestOutput]], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list[RequestOutput] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None
    render: Renderer | None = None

    def start(self, render: Renderer) -> None:
        self.render = render
        # Run in a copy of the cell's context: ipykernel keeps the parent message there, so anything
        # the watcher displays belongs to the cell that started it.
        ctx = contextvars.copy_context()
        self.thread = threading.Thread(target=ctx.run, args=(self._watch, render), daemon=True,
                                       name=f"pagedkv-{self.title}")
        self.thread.start()

    def _watch(self, render: Renderer) -> None:
        try:
            self.outputs = self.run.wait(render)
            if self.on_done is not None:
                self.on_done(self.outputs)
        except BaseException as err:   # surfaced by `%pagedkv requests` / `.error`
            logger.warning("%s (%s) failed", self.title, ", ".join(self.run.request_ids), exc_info=True)
            self.error = err
        finally:
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)
