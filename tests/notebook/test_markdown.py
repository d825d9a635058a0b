"""The streaming Markdown renderer: what the front end is handed at every step of an answer.

The oracle for "renders as" is an independent CommonMark parser (markdown-it-py), fed every
prefix of a Markdown answer as it would stream in.
"""
from __future__ import annotations

import contextlib
import threading

import pytest
from markdown_it import MarkdownIt

from jupyter_pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from jupyter_pagedkv.notebook.markdown import (MarkdownRenderer, displayable, escape, markdown_bundle,
                                               open_fence, panel_markdown)
from jupyter_pagedkv.notebook.streaming import CellRun, Panel, Throttle

MD = MarkdownIt("commonmark").enable("table")

ANSWER = """Here is a plan:

1. Read the **block table** first.
2. Then the pool.

| state | meaning |
|-------|---------|
| used  | one owner |

```python
def free(block):
    pool.release(block)
```

Done."""


def output(text: str, n: int = 3) -> RequestOutput:
    m = RequestMetrics(arrival_time=0.0, first_token_time=0.25, finish_time=0.45, num_generated_tokens=n)
    return RequestOutput("req-1", None, list(range(40)), [CompletionOutput(0, text, list(range(n)), "stop")],
                         True, 32, m)


def tokens(html: str) -> list[str]:
    return [t.type for t in MD.parse(html)]


def test_every_prefix_of_a_streaming_answer_keeps_the_footer_outside_any_code_block():
    for cut in range(1, len(ANSWER) + 1):
        panel = Panel("r1", "a", ANSWER[:cut])
        html = MD.render(panel_markdown(panel, heading=False) + "\n\n*FOOTER*")
        assert "<em>FOOTER</em>" in html, ANSWER[:cut]     # not swallowed into a fence or a table
        assert html.count("<pre>") == html.count("</pre>") <= 1, ANSWER[:cut]


def test_an_open_fence_is_closed_for_display_and_its_code_shown():
    text = "Try:\n\n```python\nx = 1\ny = "
    shown = displayable(text, finished=False)
    assert shown == "Try:\n\n```python\nx = 1\ny = \n```"
    assert MD.render(shown).count("<code class=\"language-python\">") == 1
    assert open_fence(shown.split("\n")) is None


def test_a_longer_or_tilde_fence_is_closed_with_its_own_marker():
    assert displayable("````\n```\ninner", finished=False).endswith("inner\n````")
    assert displayable("~~~\ncode\n", finished=False) == "~~~\ncode\n~~~"
    assert displayable("```\na\n```\nafter", finished=False) == "```\na\n```\nafter"   # closed: unchanged


def test_a_finished_answer_that_left_a_fence_open_is_closed_too():
    assert displayable("```\nprint(1)", finished=True) == "```\nprint(1)\n```"


def test_a_table_row_still_arriving_is_held_back_until_its_line_ends():
    head = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert displayable(head + "| 3 ", finished=False) == head
    assert displayable(head + "| 3 | 4 |\n", finished=False) == head + "| 3 | 4 |\n"
    assert MD.render(displayable(head + "| 3 ", finished=False)).count("<tr>") == 2
    assert displayable(head + "| 3", finished=True) == head + "| 3"    # finished: shown as it is


def test_one_or_two_backticks_that_may_become_a_fence_are_held_back():
    assert displayable("Code:\n``", finished=False) == "Code:\n"
    assert displayable("Code:\n`", finished=False) == "Code:\n"
    assert displayable("Inline `x` here", finished=False) == "Inline `x` here"


def test_labels_and_footers_are_escaped_so_markdown_shows_them_as_written():
    assert escape("[1] *a* `b` <i> #c |d_e") == r"\[1\] \*a\* \`b\` \<i\> \#c \|d\_e"
    p = Panel("r1", "[1] 2*3", "x")
    p.output = output("x")
    html = MD.render(panel_markdown(p, heading=True))
    assert "<strong>[1] 2*3</strong>" in html
    assert "<em>[3 tokens generated · 32/40 prompt tokens cached · TTFT 250 ms · 10.0 tok/s · stop]</em>" in html


def test_an_answer_with_no_text_yet_shows_an_ellipsis_and_several_are_stacked_under_labels():
    a, b = Panel("r1", "[1] a"), Panel("r2", "[2] b", "**bold**")
    data = markdown_bundle([a, b])
    html = MD.render(data["text/markdown"])
    assert "…" in html and "<strong>bold</strong>" in html and "<hr />" in html
    assert data["text/plain"] == "── [1] a ──\n\n\n── [2] b ──\n**bold**"


def samples_output(texts: list[str]) -> RequestOutput:
    m = RequestMetrics(arrival_time=0.0, first_token_time=0.25, finish_time=0.45, num_generated_tokens=9)
    outs = [CompletionOutput(i, t, list(range(3)), "stop") for i, t in enumerate(texts)]
    return RequestOutput("req-1", None, list(range(40)), outs, True, 32, m)


SAMPLES = ["1. Red\n2. Blue", "1. Green\n2. Gold", "Plain *text*."]


def test_n_samples_are_each_labelled_alike_and_keep_their_markdown():
    p = Panel("r1", "[1] colours", num_samples=3)
    p.text = SAMPLES[0][:6]                                   # sample 1 streaming: labelled already
    assert panel_markdown(p, heading=False).startswith("*sample 1/3*\n\n1. Red")
    p.text, p.output = SAMPLES[0], samples_output(SAMPLES)
    md = panel_markdown(p, heading=False)
    html = MD.render(md)
    assert [f"<em>sample {i}/3</em>" in html for i in (1, 2, 3)] == [True] * 3
    assert html.count("<ol>") == 2 and "<li>Gold</li>" in html and "<em>text</em>" in html
    assert "(2/3)" not in md
    # Each sample parses as it would alone: its list starts its own paragraph, not mid-line.
    for text in SAMPLES:
        assert MD.render(displayable(text, True)) in html


def test_n_samples_in_plain_text_and_html_use_the_same_labels_as_several_prompts():
    from jupyter_pagedkv.notebook.streaming import bundle
    p = Panel("r1", "[1] colours", SAMPLES[0], output=samples_output(SAMPLES), num_samples=3)
    data = bundle([p])
    assert data["text/plain"].startswith("── sample 1/3 ──\n1. Red\n2. Blue\n\n── sample 2/3 ──\n1. Green")
    assert data["text/html"].count("sample ") == 3 and "(2/3)" not in data["text/html"]
    one = Panel("r2", "[1] x", "just one", output=output("just one"))
    assert "sample" not in bundle([one])["text/plain"]          # one sample: no label, as before


def test_the_terminal_prints_sample_one_as_it_streams_and_the_others_labelled_after_it():
    from jupyter_pagedkv.notebook.streaming import PrintRenderer
    written: list[str] = []
    r = PrintRenderer(written.append)
    p = Panel("r1", "[1] colours", num_samples=3)
    p.text = "1. Red"
    r.update([p], final=False)
    p.text, p.output = SAMPLES[0], samples_output(SAMPLES)
    r.update([p], final=True)
    assert "".join(written).startswith("── sample 1/3 ──\n1. Red\n2. Blue\n\n── sample 2/3 ──\n1. Green\n2. Gold"
                                       "\n\n── sample 3/3 ──\nPlain *text*.\n[9 tokens generated")


def test_beams_are_labelled_as_beams_best_first():
    from jupyter_pagedkv.core.sampling_params import BeamSearchParams

    class Engine:
        admission = staticmethod(contextlib.nullcontext)   # EngineClient.admission

        def add_request(self, prompt, params, request_id=None, priority=0, listener=None, tenant=None):
            return "req-1"
    run = CellRun(Engine(), ["[1] p"])
    run.submit(["p"], BeamSearchParams(beam_width=2, max_tokens=4))
    run._fold(StreamDelta("req-1", "", [], True, "stop", samples_output(["best", "second"])))
    assert [label for label, _ in run.panels[0].sections()] == ["beam 1/2", "beam 2/2"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Handle:
    def __init__(self, calls) -> None:
        self.calls = calls

    def update(self, data, raw=False):
        self.calls.append(("update", data))


def test_the_throttle_renders_at_most_every_interval_and_never_leaves_text_unshown():
    clock = Clock()
    t = Throttle(MarkdownRenderer(lambda *a, **k: None).min_interval, clock)
    rendered = []
    for step in range(20):                      # a token every 50 ms for one second
        clock.now = step * 0.05
        t.changed()
        if t.due():
            rendered.append(clock.now)
            t.rendered()
    assert rendered == [0.0, 0.25, 0.5, 0.75]
    # The stream pauses after the token at 0.95: that text is due at 1.0 with nothing more arriving.
    assert t.dirty and t.timeout() == pytest.approx(0.05)
    clock.now = 0.99
    assert not t.due()
    clock.now = 1.0
    assert t.due()
    t.rendered()
    assert not t.due() and t.timeout() == 0.25           # nothing pending: wait a whole interval


class PausingEngine:
    """Streams 'one ', 'two ' to a CellRun's queue, then holds the request open until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.listener = None

    admission = staticmethod(contextlib.nullcontext)   # EngineClient.admission

    def add_request(self, prompt, params, request_id=None, priority=0, listener=None, tenant=None):
        self.listener = listener
        return "r1"

    def deltas(self) -> None:
        for text in ("one ", "two "):
            self.listener.put(StreamDelta("r1", text, [1], False))
        self.release.wait(timeout=600)   # pytest-timeout ends a test that never releases
        self.listener.put(StreamDelta("r1", "three", [1], True, "stop", output("one two three")))


def test_a_stream_that_pauses_shows_its_latest_text_before_it_resumes():
    """Two deltas arrive inside one interval, then nothing: the second must still be rendered
    (the bug this guards against left 'two' unshown until the answer went on)."""
    engine = PausingEngine()
    shown = []

    class Recorder:
        min_interval = 0.2

        def update(self, panels, final):
            shown.append((panels[0].text, final))
            if panels[0].text == "one two ":
                engine.release.set()            # seen during the pause: let the stream finish

    run = CellRun(engine, ["a"])
    run.submit(["p"], None)
    threading.Thread(target=engine.deltas, daemon=True).start()
    outputs = run.wait(Recorder())
    assert engine.release.is_set(), shown
    assert ("one two ", False) in shown and shown[-1] == ("one two three", True)
    assert outputs[0].finished


def test_several_prompts_stream_into_side_by_side_output_columns():
    import ipywidgets as w
    shown, calls = [], []

    def display(obj, display_id):
        shown.append(obj)
        return Handle(calls)

    r = MarkdownRenderer(display, min_interval=0.0, columns=True)
    a, b = Panel("r1", "[1] a", "- one"), Panel("r2", "[2] b", "```\nx")
    r.update([a, b], final=False)
    assert calls == []
    a.output, b.output = output("- one"), output("```\nx")
    r.update([a, b], final=True)
    assert len(shown) == 1 and isinstance(shown[0], w.HBox)        # displayed once, then updated
    left, right = (c.outputs[0]["data"]["text/markdown"] for c in shown[0].children)
    assert MD.render(left).count("<li>") == 1
    assert MD.render(right).count("<pre>") == 1 and "<em>[3 tokens" in MD.render(right)
    # Once every answer is in, the display is refreshed so a page without widgets shows them too.
    assert [c[0] for c in calls] == ["update"]
    bundle = shown[0]._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert "application/vnd.jupyter.widget-view+json" in data
    assert MD.render(data["text/markdown"]).count("<li>") == 1 and data["text/plain"].count("tokens generated") == 2
