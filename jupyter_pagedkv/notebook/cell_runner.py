"""CellRunner: a cell's requests from submission to their output, in the foreground or background.

The magics parse a cell's options and build its prompts; this runs them where the cell's front end
can show them: Markdown or text through a display handle in a kernel, prints in a terminal
IPython, an Output widget for `--background`. Ctrl-C aborts the cell's requests and frees their
blocks; an engine failure is raised in the cell (one line when it is the network's).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from IPython.core.error import UsageError

from ..protocol import EngineUnavailable
from .logprob_view import LogprobsView
from .markdown import MarkdownRenderer, markdown_bundle
from .options import kept_output
from .session import KernelSession
from .streaming import (BackgroundJob, CellRun, DisplayRenderer, DonePrinter, Panel, PrintRenderer, Renderer,
                        WidgetRenderer)

logger = logging.getLogger(__name__)


@dataclass
class CellRunner:
    """Runs cells for the magics of one IPython `shell` over the kernel's `session`."""

    shell: Any
    session: KernelSession

    def _in_kernel(self) -> bool:
        return getattr(self.shell, "kernel", None) is not None

    def _markdown(self, fmt: str | None) -> bool:
        """Markdown where a front end renders it: a kernel, unless --format text. A terminal
        IPython cannot render Markdown, so there it is always text."""
        return self._in_kernel() and fmt != "text"

    def _renderer(self, fmt: str | None) -> Renderer:
        if self._markdown(fmt):
            return MarkdownRenderer()
        return DisplayRenderer() if self._in_kernel() else PrintRenderer()

    def _submit(self, run: CellRun, prompts: Sequence, params, origin: str) -> None:
        engine = run.engine
        if not engine.is_running:
            engine.start()
        try:
            run.submit(prompts, params)
        except ValueError as err:   # a prompt too long for the model or the pool
            raise UsageError(str(err)) from None
        for rid in run.request_ids:
            self.session.origins[rid] = origin

    def run(self, run: CellRun, prompts: Sequence, params, origin: str, no_stream: bool,
                  fmt: str | None = None):
        """Stream the cell's requests to its output; Ctrl-C aborts them and frees their blocks."""
        renderer = self._renderer(fmt)
        if no_stream:
            renderer = FinalOnly(renderer)
        try:
            self._submit(run, prompts, params, origin)
            outputs = run.wait(renderer)
        except KeyboardInterrupt:
            n = run.abort(renderer)
            print(f"interrupted: aborted {n} request{'s' if n != 1 else ''} of this cell and freed "
                  f"{'their' if n != 1 else 'its'} blocks; the engine keeps serving", file=sys.stderr)
            raise
        self._raise_engine_error(run)
        return outputs

    def _raise_engine_error(self, run: CellRun) -> None:
        """An abort we did not ask for is an engine failure: show it, it is not the user's mistake."""
        for panel in run.panels:
            if panel.error is not None:
                if isinstance(panel.error, EngineUnavailable):   # network/server trouble: one line
                    raise UsageError(str(panel.error))
                raise panel.error

    def start_background(self, run: CellRun, prompts: Sequence, params, out_var: str | None,
                         no_stream: bool, fmt: str | None = None) -> None:
        """Submit and return at once; a watcher thread renders the result when it is done."""
        self._submit(run, prompts, params, "background")
        title = "background " + ", ".join(run.request_ids)
        ns = self.shell.user_ns

        def on_done(outputs):
            if out_var:
                try:
                    ns[out_var] = kept_output(outputs, params)
                except UsageError as err:   # no cell to raise in: keep the outputs, say why
                    ns[out_var] = outputs[0] if len(outputs) == 1 else outputs
                    logger.warning("%s: %s; %s holds the RequestOutput instead", title, err, out_var)

        job = BackgroundJob(run, title, on_done)
        renderer: Renderer
        in_kernel = self._in_kernel()
        widget = self._output_widget() if in_kernel else None
        if widget is not None:
            from IPython.display import display
            display(widget)
            renderer = WidgetRenderer(widget, markdown_bundle if self._markdown(fmt) else None)
            renderer.update(run.panels, final=False)
        elif in_kernel:   # no ipywidgets: a display handle made here, updated by the watcher
            renderer = DisplayRenderer()
            renderer.update(run.panels, final=False)
        else:
            renderer = DonePrinter(title)
            print(f"{title}: running; the result prints here when done"
                  + (f" and is stored in {out_var}" if out_var else ""))
        self.session.jobs.append(job)
        job.start(FinalOnly(renderer) if no_stream else renderer)

    @staticmethod
    def _output_widget():
        try:
            import ipywidgets
        except ImportError:
            return None
        return ipywidgets.Output()


class FinalOnly:
    """--no-stream: pass only the complete result to the wrapped renderer."""

    def __init__(self, inner: Renderer) -> None:
        self.inner = inner

    def update(self, panels: Sequence[Panel], final: bool) -> None:
        if final:
            self.inner.update(panels, final=True)


def show_logprobs(args, outputs) -> None:
    """--logprobs / --prompt-logprobs: the answers shaded by probability, below the text."""
    if args.logprobs is not None or args.prompt_logprobs is not None:
        from IPython.display import display
        display(LogprobsView(outputs))
