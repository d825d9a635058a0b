"""Docs that stay linked: every relative link, anchor and image in README.md, docs/*.md and the
notebooks' Markdown cells resolves (anchors as GitHub slugs its headings), and every image under
docs/ is shown somewhere, so a moved section or a figure with no text behind it is caught here."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

import pytest

from docs_text import ROOT, Page, load, pages

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")
PAGES = pages()


def broken_links(page: Page) -> list[str]:
    """Each link of `page` that does not resolve, as 'page:line: target (why)'."""
    problems = []
    for link in page.links():
        if link.target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = link.target.partition("#")
        if not path_part:
            if anchor not in page.anchors():
                problems.append(f"{page.name}:{link.line}: {link.target} (no heading with that anchor here)")
            continue
        target = (page.path.parent / unquote(path_part)).resolve()
        why = None
        if not target.exists():
            why = "no such file"
        elif ROOT not in target.parents and target != ROOT:
            why = "outside the repository"
        elif link.image and target.suffix.lower() not in IMAGE_SUFFIXES:
            why = "not an image"
        elif anchor and target.suffix in (".md", ".ipynb") and anchor not in load(target).anchors():
            why = f"no heading with the anchor #{anchor} in {target.relative_to(ROOT)}"
        if why:
            problems.append(f"{page.name}:{link.line}: {link.target} ({why})")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_anchor_and_image_resolves(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_image_under_docs_is_shown_somewhere():
    shown = set()
    for page in PAGES:
        for link in page.links():
            if not link.target.startswith(EXTERNAL):
                shown.add((page.path.parent / unquote(link.target.partition("#")[0])).resolve())
    images = [p for p in (ROOT / "docs").rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES]
    unused = sorted(str(p.relative_to(ROOT)) for p in images if p.resolve() not in shown)
    assert not unused, f"images under docs/ that no README, docs page or notebook shows: {unused}"


def test_the_checker_catches_a_broken_link_a_missing_anchor_and_a_missing_image(tmp_path):
    page = Page(ROOT / "docs" / "probe.md", "\n".join([
        "# Probe", "[ok](design.md#invariants) [self](#probe) ![ok](monitor.png) [no](#nowhere)",
        "[gone](no-such-page.md)", "[anchor](design.md#no-such-heading)", "![pic](no-such.png)",
        "```", "[in code](ignored.md)", "```", "`[inline](ignored.md)`"]))
    problems = broken_links(page)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "#nowhere", "no-such-page.md", "design.md#no-such-heading", "no-such.png"], problems
