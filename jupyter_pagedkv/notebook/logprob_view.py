"""`%%generate --logprobs K`: the answer with each token shaded by its probability.

The HTML is plain spans with inline colours and a `title` per token (its probability and the top
alternatives, shown on hover): no JavaScript, so it renders in a saved notebook too. Below the
text, a short table lists the tokens the model was least sure of with their alternatives, so the
answer to "why this token?" also reads where hover and colours do not (GitHub's viewer, a
terminal: the text/plain form is that table alone).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass

from ..engine.outputs import PositionLogprobs, RequestOutput

LEAST_SURE = 5     # rows of the "least sure" table per answer


@dataclass(frozen=True, slots=True)
class TokenView:
    """One token as the view shows it: its text, probability and the alternatives (text, p)."""

    text: str
    prob: float
    alternatives: tuple[tuple[str, float], ...]


def token_views(token_ids: list[int], positions: list[PositionLogprobs | None]) -> list[TokenView]:
    """Tokens with their logprobs (positions without any, such as a prompt's first, are skipped)."""
    views = []
    for token, entry in zip(token_ids, positions):
        if entry is None or token not in entry:
            continue
        chosen = entry[token]
        alts = tuple((_shown(lp.decoded_token, t), math.exp(lp.logprob))
                     for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0) if t != token)
        views.append(TokenView(_shown(chosen.decoded_token, token), math.exp(chosen.logprob), alts))
    return views


def _shown(text: str | None, token: int) -> str:
    return f"<{token}>" if text is None else text


def _shade(p: float) -> str:
    """Sure tokens stay light, unsure ones turn orange (one hue: reads in light and dark themes)."""
    return f"rgba(255, 140, 0, {0.85 * (1 - p):.2f})"


def _title(v: TokenView) -> str:
    alts = ", ".join(f"{a!r} {p:.1%}" for a, p in v.alternatives)
    return f"p={v.prob:.1%}" + (f"; alternatives: {alts}" if alts else "")


def _least_sure(views: list[TokenView]) -> list[TokenView]:
    return sorted(views, key=lambda v: v.prob)[:LEAST_SURE]


def answer_html(views: list[TokenView], heading: str) -> str:
    spans = "".join(f'<span title="{html.escape(_title(v))}" style="background:{_shade(v.prob)};'
                    f'white-space:pre-wrap">{html.escape(v.text)}</span>' for v in views)
    rows = "".join(f"<tr><td><code>{html.escape(repr(v.text))}</code></td><td>{v.prob:.1%}</td>"
                   f"<td>{html.escape(', '.join(f'{a!r} {p:.1%}' for a, p in v.alternatives))}</td></tr>"
                   for v in _least_sure(views))
    return (f"<div><b>{html.escape(heading)}</b><div style='font-family:monospace;line-height:1.6'>"
            f"{spans}</div><table><tr><th>least sure</th><th>p</th><th>alternatives</th></tr>{rows}"
            f"</table></div>")


def answer_text(views: list[TokenView], heading: str) -> str:
    lines = [heading, "  least sure: token  p  alternatives"]
    lines += [f"  {v.text!r}  {v.prob:.1%}  " + ", ".join(f"{a!r} {p:.1%}" for a, p in v.alternatives)
              for v in _least_sure(views)]
    return "\n".join(lines)


class LogprobsView:
    """The shaded answers of a cell's outputs (and their prompts, with --prompt-logprobs)."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.parts: list[tuple[str, list[TokenView]]] = []
        for i, out in enumerate(outputs):
            label = f"[{i + 1}] " if len(outputs) > 1 else ""
            if out.prompt_logprobs is not None:
                self.parts.append((f"{label}prompt", token_views(out.prompt_token_ids, out.prompt_logprobs)))
            for c in out.outputs:
                if c.logprobs is not None:
                    name = f"answer {c.index + 1}" if len(out.outputs) > 1 else "answer"
                    self.parts.append((f"{label}{name}", token_views(c.token_ids, c.logprobs)))

    def _repr_html_(self) -> str:
        legend = ("<div style='font-size:smaller'>shade: how unsure the model was of each token "
                  "(white = certain); hover a token for its probability and alternatives</div>")
        return legend + "".join(answer_html(v, h) for h, v in self.parts)

    def __repr__(self) -> str:
        return "\n".join(answer_text(v, h) for h, v in self.parts)
