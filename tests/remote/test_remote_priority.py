"""`priority=` on the server client: sent as vLLM's `priority` field when not 0 (a vLLM server
takes it under its own priority policy), checked as the local engine checks it, nothing sent
when it is bad."""
from __future__ import annotations

import pytest

from jupyter_pagedkv import Engine
from jupyter_pagedkv.core.sampling_params import SamplingParams

from fake_vllm import fake  # noqa: F401  (the fixture)

TWO = SamplingParams(max_tokens=2)


def test_priority_is_sent_as_vllms_field_and_zero_is_left_out(fake):
    handler, url = fake
    client = Engine.connect(url)
    client.generate(["ok", "ok"], TWO, priority=[2, -1])
    assert [b.get("priority") for b in handler.bodies[-2:]] in ([2, -1], [-1, 2])
    client.generate("ok", TWO)
    assert "priority" not in handler.bodies[-1]
    assert not client.live_requests()


@pytest.mark.parametrize("bad", [1.5, "1", None, True])
def test_a_bad_priority_is_the_local_engines_line_and_nothing_is_sent(fake, bad):
    handler, url = fake
    client = Engine.connect(url)
    sent = len(handler.bodies)
    with pytest.raises(ValueError, match="^priority must be an integer, got "):
        client.add_request("ok", TWO, priority=bad)
    assert len(handler.bodies) == sent and not client.live_requests()
