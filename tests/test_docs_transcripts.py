"""`python -m jupyter_pagedkv.docs`: every transcript it generates has its place in its page, is
spliced in without touching the text around it, and says on which machine and when it ran."""
from __future__ import annotations

import datetime as dt
import re

import pytest

from jupyter_pagedkv.docs.transcripts import ROOT, TRANSCRIPTS, Transcript, machine, render, splice


@pytest.mark.parametrize("name", sorted(TRANSCRIPTS))
def test_every_transcript_has_its_markers_and_a_generated_body(name):
    text = (ROOT / TRANSCRIPTS[name].page).read_text()
    body = re.search(rf"<!-- transcript: {name} -->\n(.*?)<!-- /transcript -->", text, re.S)
    assert body, f"{TRANSCRIPTS[name].page} has no markers for {name}"
    assert body.group(1).startswith(f"Written by `python -m jupyter_pagedkv.docs {name}` on a "), \
        f"{TRANSCRIPTS[name].page}: run `python -m jupyter_pagedkv.docs {name}`"


def test_splice_replaces_only_the_text_between_the_markers():
    page = "before\n<!-- transcript: x -->\nold\n<!-- /transcript -->\nafter <!-- transcript: y -->\n"
    assert splice(page, "x", "new\n") == "before\n<!-- transcript: x -->\nnew\n<!-- /transcript -->\nafter <!-- transcript: y -->\n"
    with pytest.raises(ValueError, match="no '<!-- transcript: z -->'"):
        splice(page, "z", "new\n")


def test_a_transcript_names_its_command_machine_and_date():
    t = Transcript("demo", "docs/demo.md", "$ make demo", ("python",))
    out = render(t, "hello\n", dt.datetime(2026, 12, 2, 4, 30, tzinfo=dt.timezone.utc), "2-core Some CPU (AVX2)")
    assert out == ("Written by `python -m jupyter_pagedkv.docs demo` on a 2-core Some CPU (AVX2), 2026-12-02 04:30 UTC "
                   "(the whole output, as printed):\n\n```\n$ make demo\nhello\n```\n")
    assert re.match(r"^\d+-core .+ \((AVX|no AVX)", machine())
