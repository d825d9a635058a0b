"""`--priority N` on %%generate and %%chat reaches every request of the cell (CellRun), a bad
value is one UsageError line, and `%pagedkv load` offers the third policy; no model needed."""
from __future__ import annotations

import contextlib

import pytest
from IPython.core.error import UsageError

from jupyter_pagedkv.core.tenancy import POLICIES
from jupyter_pagedkv.config import EngineConfig
from jupyter_pagedkv.core.sampling_params import SamplingParams
from jupyter_pagedkv.notebook.magics import PagedKVMagics
from jupyter_pagedkv.notebook.options import parse_line
from jupyter_pagedkv.notebook.streaming import CellRun


class Recorder:
    """Stands in for an engine: records what add_request was given."""

    def __init__(self):
        self.calls = []

    admission = staticmethod(contextlib.nullcontext)   # EngineClient.admission

    def add_request(self, prompt, params, request_id=None, priority=0, listener=None, tenant=None):
        self.calls.append((prompt, priority, tenant))
        return f"r{len(self.calls)}"

    def abort(self, rid):
        return True


@pytest.mark.parametrize("magic", [PagedKVMagics.generate, PagedKVMagics.chat])
def test_priority_is_parsed_and_defaults_to_zero(magic):
    head = "s " if magic is PagedKVMagics.chat else ""
    assert parse_line(magic, head + "--priority -2").priority == -2
    assert parse_line(magic, head).priority == 0
    with pytest.raises(UsageError, match="--priority: invalid int value: '1.5'"):
        parse_line(magic, head + "--priority 1.5")


def test_a_cell_run_sends_its_priority_with_every_prompt():
    engine = Recorder()
    CellRun(engine, ["a", "b"], "alice", 3).submit(["x", "y"], SamplingParams(max_tokens=2))
    assert engine.calls == [("x", 3, "alice"), ("y", 3, "alice")]


def test_load_offers_every_policy_the_scheduler_knows():
    choices = {f.name: f.metadata["choices"] for f in EngineConfig.__dataclass_fields__.values()}
    assert tuple(choices["scheduling_policy"]) == POLICIES
    with pytest.raises(ValueError, match=r"^scheduling_policy must be 'fcfs', 'fair' or 'priority', got 'lifo'$"):
        EngineConfig(scheduling_policy="lifo")
