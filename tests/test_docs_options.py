"""Docs that name only what exists: every magic option (`%pagedkv CMD --x`, `%%generate --x`,
`%%chat --x`) and every `python -m jupyter_pagedkv.bench NAME [--x]` that README.md and docs/*.md
write is checked against the real parsers (the magics' own `magic_arguments` parsers, the
sub-command parsers they call, and each benchmark's argparse through its `--help`), and every
quoted engine summary matches the format the code prints today (a tail over fewer than 20
requests is "max", never "p99"). New options pass by themselves: nothing here lists them."""
from __future__ import annotations

import functools
import re
from dataclasses import MISSING, dataclass, fields

import pytest

from docs_text import Page, pages
from package_command import run_command

MAGIC = re.compile(r"(%%generate|%%chat|%chat|%pagedkv)(?![\w?])(.*)")
BENCH = re.compile(r"python -m jupyter_pagedkv\.bench(?:\s+([a-z][\w-]*))?(.*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
INLINE_CODE = re.compile(r"`([^`]+)`")  # one backtick: what the docs use around commands
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
EXTRA_PAGEDKV = ("connect", "disconnect", "tenant", "record", "replay")   # dispatched before the main parser


@dataclass(frozen=True)
class Mention:
    """One command the docs write: where, which parser, the options they give it."""
    where: str
    command: str
    options: tuple[str, ...]


def snippets(page: Page) -> list[tuple[int, str]]:
    """The code the page shows: each line of a fenced block, and each inline code span (which may
    wrap onto the next line) elsewhere, with its line number."""
    out, fenced = [], False
    for i, line in enumerate(page.text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif fenced:
            out.append((i, line))
    for start, text in page.paragraphs():
        out += [(start + text.count("\n", 0, m.start()), " ".join(m.group(1).split()))
                for m in INLINE_CODE.finditer(text)]
    return sorted(out)


def mentions(page: Page) -> list[Mention]:
    found = []
    for line, text in snippets(page):
        where = f"{page.name}:{line}"
        for m in MAGIC.finditer(text):
            magic, rest = m.group(1), m.group(2)
            rest = MAGIC.split(rest)[0]                      # up to the next magic on the line
            if magic == "%pagedkv":
                word = rest.split()[0] if rest.split() else ""
                if not re.fullmatch(r"[a-z][\w-]*", word):    # `%pagedkv?`, `[options]`, COMMAND
                    continue
                if word == "bench":
                    name = rest.split()[1] if len(rest.split()) > 1 else ""
                    if re.fullmatch(r"[a-z][\w-]*", name):
                        found.append(Mention(where, f"bench {name}", tuple(OPTION.findall(rest))))
                    continue
                found.append(Mention(where, f"%pagedkv {word}", tuple(OPTION.findall(rest))))
            else:
                found.append(Mention(where, magic.replace("%chat", "%%chat").replace("%%%", "%%"),
                                     tuple(OPTION.findall(rest))))
        for m in BENCH.finditer(text):
            if m.group(1):
                found.append(Mention(where, f"bench {m.group(1)}", tuple(OPTION.findall(m.group(2)))))
    return found


# -- the real parsers ---------------------------------------------------------------------------
def option_strings(parser) -> set[str]:
    return set(parser._option_string_actions)


@functools.lru_cache(maxsize=None)
def bench_help(name: str) -> str | None:
    """`python -m jupyter_pagedkv bench NAME --help` run in this process; None for an unknown NAME."""
    code, text = run_command(["bench", name, "--help"])
    return None if f"unknown benchmark {name!r}" in text or (code == 2 and "usage" not in text) else text


def known_options(command: str) -> set[str] | None:
    """The option strings `command` accepts, or None if the command itself does not exist."""
    from jupyter_pagedkv.notebook.magics import COMMANDS, PagedKVMagics
    if command.startswith("bench "):
        text = bench_help(command.split()[1])
        return None if text is None else set(OPTION.findall(text)) | {"--help"}
    if command == "%%generate":
        return option_strings(PagedKVMagics.generate.parser)
    if command == "%%chat":
        return option_strings(PagedKVMagics.chat.parser)
    word = command.split()[1]
    if word == "connect":
        from jupyter_pagedkv.notebook.options import connect_parser
        return option_strings(connect_parser())
    if word == "tenant":
        from jupyter_pagedkv.notebook.tenants import tenant_parser
        return option_strings(tenant_parser())
    if word == "plan":
        from jupyter_pagedkv.sim.plan import parser
        return option_strings(parser())
    if word == "disconnect":
        return set()
    if word == "record":
        return {"--keep-prompts"}
    if word == "replay":
        from jupyter_pagedkv.notebook.lab import _parser
        return option_strings(_parser())
    if word not in COMMANDS:
        return None
    return option_strings(PagedKVMagics.pagedkv.parser) if word == "load" else set()


def unknown(found: list[Mention]) -> list[str]:
    problems = []
    for m in found:
        known = known_options(m.command)
        if known is None:
            problems.append(f"{m.where}: {m.command} (no such command)")
            continue
        problems += [f"{m.where}: {m.command} {o} (no such option)" for o in m.options if o not in known]
    return problems


MD_PAGES = pages(with_notebooks=False)


@pytest.mark.parametrize("page", MD_PAGES, ids=lambda p: p.name)
def test_every_magic_option_and_bench_command_the_docs_name_exists(page):
    problems = unknown(mentions(page))
    assert not problems, "the docs name what the parsers do not know:\n" + "\n".join(problems)


def test_the_docs_name_the_commands_this_test_is_about():
    """So a change in how the docs are read cannot silently check nothing."""
    commands = {m.command for p in MD_PAGES for m in mentions(p)}
    assert {"%pagedkv load", "%%generate", "%%chat", "bench tail", "bench throughput"} <= commands


def test_a_renamed_option_or_command_is_reported():
    page = Page(MD_PAGES[0].path, "\n".join([
        "`%%generate --max-token 8`, `%pagedkv load --dtype float32 --blocksize 8`",
        "```", "In [3]: %%chat tutor --max-tokens 40 --sytem hi", "%pagedkv unlaod",
        "python -m jupyter_pagedkv.bench tial --scale sim", "python -m jupyter_pagedkv.bench tail --scael sim",
        "```"]))
    assert [p.split(": ", 1)[1] for p in unknown(mentions(page))] == [
        "%%generate --max-token (no such option)", "%pagedkv load --blocksize (no such option)",
        "%%chat --sytem (no such option)", "%pagedkv unlaod (no such command)",
        "bench tial (no such command)", "bench tail --scael (no such option)"]


# -- quoted engine summaries --------------------------------------------------------------------
def shape(line: str) -> str:
    return NUMBER.sub("#", line.strip())


@functools.lru_cache(maxsize=None)
def current_summary_shapes() -> dict[str, set[str]]:
    """label -> the shapes `EngineStats.summary()` prints today (numbers as '#'), made from a
    stats object with every number filled in, over a small run and a large one."""
    from jupyter_pagedkv.core.stats import EngineStats
    shapes: dict[str, set[str]] = {}
    for count in (8, 30):
        values = {f.name: 1 for f in fields(EngineStats) if f.default is MISSING and f.default_factory is MISSING}
        stats = EngineStats(**values, spec_proposed_tokens=1, spec_accepted_tokens=1,
                            latency_percentiles={k: {"p50": 1.0, "p90": 1.0, "p99": 1.0, "count": count}
                                                 for k in ("ttft", "latency")})
        for line in stats.summary().splitlines():
            shapes.setdefault(line.split(":")[0], set()).add(shape(line))
    return shapes


SUMMARY_BLOCK = re.compile(r"requests: \d+ running, \d+ waiting, (\d+) finished")
LABEL = re.compile(r"^\s*((?:recent )?throughput|blocks|waste|prefix cache|requests|latency|speculative):")


def stale_summaries(page: Page) -> list[str]:
    """Lines of quoted `EngineStats.summary()` output whose form the code no longer prints, and
    latency tails named "p99" over fewer than 20 finished requests."""
    from jupyter_pagedkv.core.stats import MIN_TAIL_SAMPLES
    problems, shapes = [], current_summary_shapes()
    for block in page.code_blocks():
        finished = SUMMARY_BLOCK.search(block)
        if not finished:
            continue
        for line in block.splitlines():
            m = LABEL.match(line)
            if not m:
                continue
            if shape(line) not in shapes.get(m.group(1), set()):
                problems.append(f"{page.name}: {line.strip()!r} is not a line the engine prints today")
            if m.group(1) == "latency" and int(finished.group(1)) < MIN_TAIL_SAMPLES and "p99" in line:
                problems.append(f"{page.name}: {line.strip()!r} names a p99 of {finished.group(1)} requests "
                                f"(the engine prints 'max' below {MIN_TAIL_SAMPLES})")
    return problems


@pytest.mark.parametrize("page", MD_PAGES, ids=lambda p: p.name)
def test_quoted_engine_summaries_match_the_format_printed_today(page):
    problems = stale_summaries(page)
    assert not problems, "\n".join(problems)


def test_a_stale_summary_is_reported():
    page = Page(MD_PAGES[0].path, "\n".join([
        "```", "requests: 0 running, 0 waiting, 8 finished, 0 preemptions",
        "throughput: 8.2 generated tokens/s",
        "latency: TTFT p50 535 ms / p99 535 ms, end-to-end p50 3.95 s / p99 4.64 s", "```"]))
    problems = stale_summaries(page)
    assert len(problems) == 2 and "not a line the engine prints today" in problems[0] \
        and "p99 of 8 requests" in problems[1], problems
