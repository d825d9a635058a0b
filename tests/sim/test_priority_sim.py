"""The simulator runs scheduling_policy="priority" through the same scheduler as the engine: the
same requests with mixed priorities give the same schedule step for step, preemptions included."""
from __future__ import annotations

import pytest

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.sim import Simulator
from jupyter_pagedkv.sim.serve import TimedPrompt
from jupyter_pagedkv.sim.validate import offline_check, sim_config_of
from jupyter_pagedkv.testing.models import random_prompts

MODEL = tiny_model("llama", seed=8)


@pytest.mark.parametrize("kwargs", [dict(), dict(preemption_mode="swap", swap_space="4MiB")],
                         ids=["recompute", "swap"])
def test_priority_schedule_is_reproduced_step_for_step(make_engine, kwargs):
    engine = make_engine(MODEL, block_size=4, num_blocks=24, scheduling_policy="priority", **kwargs)
    assert sim_config_of(engine).scheduling_policy == "priority"
    prompts = [TimedPrompt(f"r{i}", 0.0, p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                           priority=(7 * i) % 4)
               for i, p in enumerate(random_prompts(8, 256, seed=21))]
    check, trace = offline_check(engine, prompts)
    assert check.identical and check.real_preemptions > 0, check.line()
    first = {rid: n for n, step in reversed(list(enumerate(trace))) for rid, *_ in step.chunks}
    by_priority = sorted(prompts, key=lambda p: p.priority)
    assert first[by_priority[0].request_id] == 0 and first[by_priority[-1].request_id] > 0


def test_an_unknown_policy_in_the_simulator_is_one_line():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, fair, priority, got 'lifo'"):
        Simulator.for_gpu(scheduling_policy="lifo").run([])
