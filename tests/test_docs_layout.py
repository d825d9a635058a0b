"""The docs' module lists keep up with the package: every module of every subpackage (and every
kernel file) is named in docs/design.md's layer list, and in docs/development.md's table row of
its subpackage, so a module added without a word in either fails here and says where."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jupyter_pagedkv"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
LISTED_IN_DEVELOPMENT = [s for s in SUBPACKAGES if s != "bench"]    # bench/: "command lines only"


def modules(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if not p.stem.startswith("__")}


def design_layers() -> str:
    text = (ROOT / "docs/design.md").read_text()
    return re.search(r"## Layers\n\n```\n(.*?)```", text, re.S).group(1)


def layer_block(layers: str, name: str) -> str:
    """The lines of one subpackage's entry in the layer list (up to the next entry)."""
    found = re.search(rf"^  {re.escape(name)}/ (.*?)(?=^ {{0,2}}\S|\Z)", layers, re.S | re.M)
    assert found, f"docs/design.md's layer list has no entry for {name}/"
    return found.group(1)


def named(text: str) -> set[str]:
    """The names an entry lists: its words outside parentheses (the explanations), so a module is
    not counted as listed because an explanation happens to use its name as a word."""
    while True:
        inner = re.sub(r"\([^()]*\)", " ", text)
        if inner == text:
            return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
        text = inner


@pytest.mark.parametrize("sub", [s for s in SUBPACKAGES if s not in ("bench",)])
def test_design_md_names_every_module_of_each_subpackage(sub):
    missing = modules(PACKAGE / sub) - named(layer_block(design_layers(), sub))
    assert not missing, f"docs/design.md, Layers, {sub}/: name {sorted(missing)} (what each is for)"


def test_design_md_names_every_kernel_file():
    block = re.search(r"^kernels/ (.*)", design_layers(), re.S | re.M).group(1)
    missing = modules(ROOT / "kernels") - named(block)
    assert not missing, f"docs/design.md, Layers, kernels/: name {sorted(missing)}"


@pytest.mark.parametrize("sub", LISTED_IN_DEVELOPMENT)
def test_development_md_lists_every_module_of_each_subpackage(sub):
    rows = [line for line in (ROOT / "docs/development.md").read_text().splitlines()
            if line.startswith("| ") and f"`{sub}/`" in line.split("|")[1]]
    assert rows, f"docs/development.md's layout table has no row for {sub}/"
    missing = modules(PACKAGE / sub) - set(re.findall(r"`([\w.]+)`", rows[0].split("|")[2]))
    assert not missing, f"docs/development.md, the {sub}/ row: list {sorted(missing)}"


def test_design_md_names_every_engine_option():
    from dataclasses import fields

    from jupyter_pagedkv.config import EngineConfig

    text = (ROOT / "docs/design.md").read_text()
    listed = re.search(r"`EngineConfig` fields \(.*?\n\n", text, re.S)
    assert listed, "docs/design.md has no 'EngineConfig fields' paragraph"
    missing = {f.name for f in fields(EngineConfig)} - set(re.findall(r"`(\w+)`", listed.group(0)))
    assert not missing, f"docs/design.md, 'EngineConfig fields': name {sorted(missing)}"


def test_python_api_md_names_every_engine_option():
    """The README sends readers to docs/python-api.md for every engine option."""
    from dataclasses import fields

    from jupyter_pagedkv.config import EngineConfig

    named_there = set(re.findall(r"`(\w+)`", (ROOT / "docs/python-api.md").read_text()))
    missing = {f.name for f in fields(EngineConfig)} - named_there
    assert not missing, f"docs/python-api.md: name the engine options {sorted(missing)}"
