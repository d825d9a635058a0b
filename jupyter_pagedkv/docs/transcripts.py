"""`python -m jupyter_pagedkv.docs [NAME ...]`: the docs' transcripts, run for real and written back.

A transcript in a docs page sits between `<!-- transcript: NAME -->` and `<!-- /transcript -->`.
This command runs what it shows (`make demo`'s program, or a terminal IPython session of magics,
each in a fresh process, as a reader would) and replaces the text between the markers with the
real output, headed by the machine and the date, so no transcript can quietly go stale: re-run
this after a change to what they print (tests/test_docs_options.py checks that the quoted summary
lines still have the current form).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One terminal IPython session: each cell as typed, its output as printed.
MAGIC_CELLS = [
    "%load_ext jupyter_pagedkv",
    "%pagedkv load --dtype float32",
    "%%generate --max-tokens 24\nWhat is the capital of France?\n---\nName three primary colours.",
    "%%chat tutor --max-tokens 40\nI'm learning Python. What is a list comprehension? Answer in one sentence.",
    "%%chat tutor --max-tokens 40\nShow me one short example.",
    "%pagedkv requests",
    "%pagedkv status",
    "%%generate --beams 3 --max-tokens 16 --out beams\nName a famous bridge.",
    "print(', '.join(f'{o.score:.3f}' for o in beams.outputs))",
    "%pagedkv unload",
]

_SESSION = """
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance(colors="nocolor")
for i, cell in enumerate(CELLS, 1):
    lines = cell.split("\\n")
    print(f"In [{i}]: {lines[0]}" + "".join(f"\\n   ...: {l}" for l in lines[1:]), flush=True)
    result = shell.run_cell(cell, store_history=True)
    sys.stdout.flush()
    if not result.success:
        raise SystemExit(f"cell {i} failed: {result.error_in_exec or result.error_before_exec}")
    print(flush=True)
"""


@dataclass(frozen=True)
class Transcript:
    """A transcript in `page`: `command` is how a reader runs it, `argv` what this runs."""
    name: str
    page: str
    command: str
    argv: tuple[str, ...]


TRANSCRIPTS = {
    "demo": Transcript("demo", "docs/demo.md",
                       "$ python -m jupyter_pagedkv demo     # what make demo runs once .venv is set up",
                       (sys.executable, "-m", "jupyter_pagedkv", "demo")),
    "plan": Transcript("plan", "docs/capacity.md",
                       "$ python -m jupyter_pagedkv plan Llama-3-70B --gpu H100-80GB --num-gpus 2",
                       (sys.executable, "-m", "jupyter_pagedkv", "plan", "Llama-3-70B", "--gpu", "H100-80GB",
                        "--num-gpus", "2")),
    "magics": Transcript("magics", "docs/magics.md", "$ ipython",
                         (sys.executable, "-c", f"CELLS = {MAGIC_CELLS!r}\n{_SESSION}")),
}


def machine() -> str:
    """The CPU (model, cores, the ISA features that change dtype and speed), or the GPU."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.+)", info).group(1).strip()
        flags = set(re.search(r"flags\s*:\s*(.+)", info).group(1).split())
    except (OSError, AttributeError):
        pass
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
                                   ("amx_tile", "AMX")) if flag in flags] or ["AVX2" if "avx2" in flags else "no AVX"]
    load = f", load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    return f"{os.cpu_count()}-core {model} ({', '.join(isa)}){load}"


def splice(page_text: str, name: str, body: str) -> str:
    """`page_text` with the text between NAME's markers replaced by `body`; ValueError if the
    page has no such markers (a transcript must be placed before it can be generated)."""
    pattern = re.compile(rf"(<!-- transcript: {re.escape(name)} -->\n).*?(<!-- /transcript -->)", re.S)
    if not pattern.search(page_text):
        raise ValueError(f"no '<!-- transcript: {name} -->' ... '<!-- /transcript -->' markers in the page")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), page_text, count=1)


def render(t: Transcript, output: str, when: dt.datetime, where: str) -> str:
    return (f"Written by `python -m jupyter_pagedkv.docs {t.name}` on a {where}, "
            f"{when:%Y-%m-%d %H:%M} UTC (the whole output, as printed):\n\n"
            f"```\n{t.command}\n{output.rstrip()}\n```\n")


def run(t: Transcript) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(t.argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{t.name}: {' '.join(t.argv[:3])} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.docs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help=f"which transcripts (default: all of {', '.join(TRANSCRIPTS)})")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in TRANSCRIPTS]
    if unknown:
        ap.error(f"no transcript named {', '.join(unknown)}: choose from {', '.join(TRANSCRIPTS)}")
    where = machine()
    for name in args.names or list(TRANSCRIPTS):
        t = TRANSCRIPTS[name]
        print(f"running {name} for {t.page} ...", flush=True)
        output = run(t)
        page = ROOT / t.page
        page.write_text(splice(page.read_text(), name, render(t, output, dt.datetime.now(dt.timezone.utc), where)))
        print(f"wrote {t.page}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
