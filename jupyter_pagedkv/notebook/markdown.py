"""Streaming Markdown: what to hand the front end's Markdown renderer while an answer is still
arriving, so that a half-written construct never breaks the layout.

- An unclosed code fence (``` or ~~~, up to three spaces of indent) is closed for display; without
  that, everything after it, the footer included, would be swallowed into the code block.
- While streaming, a last line that is not finished yet is held back when it could still become
  something else: a table row (it starts with `|`), or one or two backticks / tildes that may be
  the start of a fence.
A finished answer is shown whole, its unclosed fence (if the model left one open) closed.
"""
from __future__ import annotations

import re

from .streaming import _plain, footer

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_FENCE_START = re.compile(r"^ {0,3}(`{1,2}|~{1,2})$")


def open_fence(lines: list[str]) -> str | None:
    """The fence (e.g. "```") left open after these lines, or None."""
    fence = None
    for line in lines:
        m = _FENCE.match(line)
        if not m:
            continue
        marker = m.group(1)
        if fence is None:
            fence = marker
        elif marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip()[len(marker):]:
            fence = None                          # a closing fence: same character, at least as long
    return fence


def displayable(text: str, finished: bool) -> str:
    """`text` made safe to render now (see the module docstring)."""
    if not finished and text and not text.endswith("\n"):
        head, _, last = text.rpartition("\n")
        stripped = last.strip()
        if stripped.startswith("|") or _FENCE_START.match(last):
            text = head + ("\n" if head else "")
    fence = open_fence(text.split("\n"))
    if fence is not None:
        text = text + ("" if text.endswith("\n") else "\n") + fence
    return text


_SPECIAL = re.compile(r"([\\`*_\[\]<>#|])")


def escape(text: str) -> str:
    """Plain text (a label, the footer) that Markdown shows as written."""
    return _SPECIAL.sub(r"\\\1", text)


def panel_markdown(panel, heading: bool) -> str:
    """One answer as Markdown: its label (several prompts), the text so far, the footer line."""
    parts = [f"**{escape(panel.label)}**"] if heading else []
    for label, text in panel.sections():      # several samples: each its own labelled paragraph
        if label:
            parts.append(f"*{escape(label)}*")
        body = displayable(text, panel.finished)
        parts.append(body if body.strip() else ("…" if not panel.finished else ""))
    if panel.output is not None:
        parts.append(f"*{escape(footer(panel.output))}*")
    return "\n\n".join(p for p in parts if p)


def markdown_bundle(panels) -> dict[str, str]:
    """Every answer as one Markdown document (stacked under their labels), with the plain text."""
    md = "\n\n---\n\n".join(panel_markdown(p, heading=len(panels) > 1) for p in panels)
    return {"text/markdown": md, "text/plain": _plain(panels)}


class MarkdownRenderer:
    """A notebook cell's answers rendered as Markdown by the front end (lists, emphasis, tables,
    code blocks highlighted by its own renderer), re-rendered in place while they stream: at most
    every `min_interval` seconds (CellRun.wait's Throttle enforces it; a Markdown re-render costs
    the front end more than plain text). One prompt: one display. Several: side-by-side columns,
    one Output area each (ipywidgets), stacked under their labels without ipywidgets."""

    def __init__(self, display=None, min_interval: float = 0.25, columns: bool | None = None) -> None:
        if display is None:
            from IPython.display import display
        self._display = display
        self.min_interval = min_interval
        self._handle = None
        self._outs = None
        self._box = None
        if columns is None:
            try:
                import ipywidgets  # noqa: F401
                columns = True
            except ImportError:
                columns = False
        self._columns = columns
        self.num_renders = 0

    def update(self, panels, final: bool) -> None:
        self.num_renders += 1
        if len(panels) > 1 and self._columns:
            self._update_columns(panels)
            return
        data = markdown_bundle(panels)
        if self._handle is None:
            self._handle = self._display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)

    def _update_columns(self, panels) -> None:
        import ipywidgets as w

        if self._outs is None:
            # Columns share the width and wrap onto a new row rather than run off the cell's edge.
            self._outs = [w.Output(layout=w.Layout(flex="1 1 0", min_width="11em", margin="0 1.5em 0 0"))
                          for _ in panels]
            self._box = AnswerColumns(self._outs, layout=w.Layout(align_items="flex-start", flex_flow="row wrap"))
            self._handle = self._display(self._box, display_id=True)
        for out, panel in zip(self._outs, panels):
            out.outputs = ({"output_type": "display_data", "metadata": {},
                            "data": {"text/markdown": panel_markdown(panel, heading=True),
                                     "text/plain": _plain([panel])}},)
        self._box.panels = list(panels)
        if all(p.finished for p in panels) and self._handle is not None:
            self._handle.update(self._box)     # the saved output's fallback: the final answers


def _answer_columns():
    import ipywidgets as w

    class AnswerColumns(w.HBox):
        """The side-by-side Output columns, whose display also carries every answer as Markdown and
        plain text: what a page without widgets (GitHub, an export) shows instead of a repr."""

        panels: list = []

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            if self.panels:
                data.update(markdown_bundle(self.panels))
            return bundle

    return AnswerColumns


def AnswerColumns(children, **kwargs):
    """An `AnswerColumns` widget (the class is built on first use: ipywidgets is optional)."""
    global _ANSWER_COLUMNS
    if _ANSWER_COLUMNS is None:
        _ANSWER_COLUMNS = _answer_columns()
    return _ANSWER_COLUMNS(children, **kwargs)


_ANSWER_COLUMNS = None
