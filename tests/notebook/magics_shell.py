"""The shared part of the magics' tests in an InteractiveShell (terminal mode: plain incremental
prints), on the embedded model: the shell with the extension and an engine loaded (`ip`, one per
test module), `run` for a cell, the check that every test leaves the engine with no live request
(`engine_left_clean`, autouse once imported) and the greedy reference `greedy_alone`.

Imported by test_magics_pagedkv.py, test_magics_generate.py and test_magics_chat.py:
`from magics_shell import GEN, engine_left_clean, ip, run  # noqa: F401  (fixtures)`.
"""
from __future__ import annotations

import pytest

from jupyter_pagedkv.notebook.session import current

GEN = "%%generate --max-tokens 8"


@pytest.fixture(scope="module")
def ip():
    from IPython.testing.globalipapp import get_ipython, start_ipython

    shell = start_ipython() or get_ipython()   # None once another module started it
    shell.run_line_magic("load_ext", "jupyter_pagedkv")
    shell.run_line_magic("pagedkv", "load --kv-cache-memory 128MiB --dtype float32")
    yield shell
    if current().engine is not None:
        current().unload()


def run(ip, cell: str):
    """Run a cell; re-raise what it raised (UsageError included) so tests can assert on it."""
    result = ip.run_cell(cell)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result.result


@pytest.fixture(autouse=True)
def engine_left_clean(request):
    yield
    engine = current().engine
    if engine is not None and "ip" in request.fixturenames:
        assert current().wait_background(120)
        assert not engine.live_requests()
        engine.check_invariants()
        assert all(b.ref_count == 0 for b in engine._pool.blocks)


def greedy_alone(prompt_text: str, max_tokens: int) -> str:
    """The reference: the same chat-templated prompt, alone on the engine, greedy."""
    from jupyter_pagedkv import SamplingParams

    engine = current().engine
    ids = engine.apply_chat_template([{"role": "user", "content": prompt_text}])
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text
