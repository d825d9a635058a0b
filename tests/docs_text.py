"""The project's prose as the docs tests read it: README.md, docs/*.md and the notebooks' Markdown
cells, each a `Page` with its text, its links and its headings' anchors (GitHub's slugs), so the
link test and the options test agree on what "the docs" are."""
from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)[^`]*?\1(?!`)")


@dataclass(frozen=True)
class Link:
    target: str
    line: int
    image: bool


@dataclass
class Page:
    """One Markdown source: a .md file, or a notebook's Markdown cells joined in order."""
    path: Path
    text: str

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    def prose_lines(self) -> list[tuple[int, str]]:
        """(line number, line) outside fenced code blocks."""
        out, fenced = [], False
        for i, line in enumerate(self.text.splitlines(), 1):
            if FENCE.match(line.lstrip()):
                fenced = not fenced
                continue
            if not fenced:
                out.append((i, line))
        return out

    def paragraphs(self) -> list[tuple[int, str]]:
        """(first line number, text) of each run of prose lines: a code span or a link may wrap
        onto the next line, so they are looked for in whole paragraphs."""
        out: list[tuple[int, str]] = []
        start, lines, last = 0, [], -1
        for i, line in self.prose_lines():
            if not line.strip() or i != last + 1:
                if lines:
                    out.append((start, "\n".join(lines)))
                start, lines = i, []
            if line.strip():
                if not lines:
                    start = i
                lines.append(line)
            last = i
        if lines:
            out.append((start, "\n".join(lines)))
        return out

    def code_blocks(self) -> list[str]:
        """The text of every fenced code block."""
        blocks, current = [], None
        for line in self.text.splitlines():
            if FENCE.match(line.lstrip()):
                if current is None:
                    current = []
                else:
                    blocks.append("\n".join(current))
                    current = None
            elif current is not None:
                current.append(line)
        return blocks

    def links(self) -> list[Link]:
        found = []
        for start, text in self.paragraphs():
            bare = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
            line = lambda m: start + bare.count("\n", 0, m.start())
            found += [Link(m.group(3), line(m), m.group(1) == "!") for m in LINK.finditer(bare)]
            found += [Link(m.group(1), line(m), "<img" in m.group(0).lower()) for m in HTML_SRC.finditer(bare)]
        return found

    def anchors(self) -> set[str]:
        """GitHub's heading ids: the slug of each heading, `-1`, `-2`, ... for repeats."""
        seen: dict[str, int] = {}
        result = set()
        for _, line in self.prose_lines():
            m = HEADING.match(line)
            if not m:
                continue
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            result.add(slug if n == 0 else f"{slug}-{n}")
        for m in re.finditer(r"<a\s+(?:name|id)=\"([^\"]+)\"", self.text):
            result.add(m.group(1))
        return result


def github_slug(heading: str) -> str:
    """The id GitHub gives a heading: its text (links reduced to their words, Markdown marks
    dropped), lower case, punctuation other than `-` and `_` removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("*.ipynb"))


def load(path: Path) -> Page:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        return Page(path, text)
    return Page(path, path.read_text())


def pages(with_notebooks: bool = True) -> list[Page]:
    return [load(p) for p in markdown_files() + (notebooks() if with_notebooks else [])]
