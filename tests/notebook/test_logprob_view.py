"""`%%generate --logprobs K`'s view, without a model: tokens shaded by probability, alternatives on
hover, and a table of the least sure tokens that reads with no JavaScript, hover or colour."""
from __future__ import annotations

import math

from jupyter_pagedkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jupyter_pagedkv.notebook.logprob_view import LogprobsView, token_views


def answer() -> RequestOutput:
    """'Hi <b>!' as three tokens: sure, unsure (its alternative more likely), fairly sure."""
    lps = [{10: Logprob(math.log(0.95), 1, "Hi")},
           {11: Logprob(math.log(0.2), 2, " <b>"), 12: Logprob(math.log(0.7), 1, " there")},
           {13: Logprob(math.log(0.6), 1, "!"), 14: Logprob(math.log(0.3), 2, ".")}]
    out = CompletionOutput(0, "Hi <b>!", [10, 11, 13], "length", logprobs=lps, cumulative_logprob=-2.0)
    return RequestOutput("r", "x", [1, 2], [out], True, 0, RequestMetrics(0.0),
                         prompt_logprobs=[None, {2: Logprob(math.log(0.5), 1, "y")}])


def test_token_views_carry_probabilities_and_alternatives_by_rank():
    views = token_views(answer().outputs[0].token_ids, answer().outputs[0].logprobs)
    assert [v.text for v in views] == ["Hi", " <b>", "!"]
    assert [round(v.prob, 2) for v in views] == [0.95, 0.2, 0.6]
    assert [(a, round(p, 2)) for a, p in views[1].alternatives] == [(" there", 0.7)]
    assert [(a, round(p, 2)) for a, p in views[2].alternatives] == [(".", 0.3)]


def test_html_shades_each_token_titles_its_alternatives_and_escapes_text():
    page = LogprobsView([answer()])._repr_html_()
    assert "<script" not in page and " &lt;b&gt;</span>" in page and " <b>" not in page
    assert page.count('<span title="') == 4                   # 3 answer tokens + 1 prompt token
    assert "p=20.0%; alternatives: &#x27; there&#x27; 70.0%" in page
    assert "rgba(255, 140, 0, 0.68)" in page                  # p = 0.2 is shaded darker than ...
    assert "rgba(255, 140, 0, 0.04)" in page                  # ... p = 0.95


def test_text_form_lists_the_least_sure_tokens_first():
    text = repr(LogprobsView([answer()]))
    lines = text.splitlines()
    assert lines[0] == "prompt" and "answer" in lines
    body = lines[lines.index("answer") + 2:]
    assert body[0].startswith("  ' <b>'  20.0%  ' there' 70.0%")
    assert body[1].startswith("  '!'  60.0%")
