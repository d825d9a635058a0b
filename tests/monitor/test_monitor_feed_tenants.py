"""The monitor feed by tenant: each frame names the tenants holding its blocks (a block two tenants
share under prefix_cache_scope="global" lists both), diffs carry them for the touched blocks only,
and the gauges carry the per-tenant stats, through the widget's traits and the comm alike."""
from __future__ import annotations

import json

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.core.stats import UNNAMED
from jupyter_pagedkv.monitor.channel import open_comm, snapshot
from jupyter_pagedkv.monitor.feed import feed_for

MODEL = tiny_model("llama", seed=3)
PREFIX = list(range(3, 19))          # 16 tokens: 4 full blocks of 4, shared by every tenant
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class TenantReplica:
    """A front end's view of the per-block tenants: the full frame, then each diff in order."""

    def __init__(self) -> None:
        self.tenants: dict[int, list[str]] = {}
        self.frames = []

    def __call__(self, frame) -> None:
        self.frames.append(frame)
        if frame.full:
            self.tenants = dict(frame.tenants)
            return
        for i, names in frame.tenants.items():
            if names:
                self.tenants[i] = names
            else:
                self.tenants.pop(i, None)


def two_tenants(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, prefix_cache_scope="global")
    engine.set_tenant("alice", weight=2.0)
    feed = feed_for(engine, threaded=False)
    replica = TenantReplica()
    feed.subscribe(replica)
    return engine, feed, replica


def test_diffs_keep_each_blocks_tenants_as_the_engine_has_them(make_engine):
    engine, feed, replica = two_tenants(make_engine)
    engine.add_request(PREFIX + [40, 41, 42], GREEDY, tenant="alice")
    engine.step()
    feed.publish()
    engine.add_request(PREFIX + [50, 51], GREEDY, tenant="bob")   # hits alice's 4 prefix blocks
    engine.add_request([60, 61, 62, 63, 64], GREEDY)               # no tenant
    seen_both = False
    while engine.has_unfinished_requests():
        engine.step()
        frame = feed.publish()
        assert replica.tenants == {int(k): v for k, v in engine.pool_snapshot()["tenants"].items()}
        seen_both |= any(v == ["alice", "bob"] for v in replica.tenants.values())
        if frame is not None:                 # a diff lists tenants only for the blocks it carries
            assert set(frame.tenants) <= set(frame.ids.tolist())
    assert seen_both
    assert replica.tenants == {}              # all finished: nothing in use, nobody holds a block
    assert {n for f in replica.frames for v in f.tenants.values() for n in v} == {"alice", "bob", UNNAMED}


def test_the_gauges_carry_the_per_tenant_stats_and_the_policy(make_engine):
    engine, feed, replica = two_tenants(make_engine)
    engine.add_request(PREFIX, GREEDY, tenant="bob")
    engine.step()
    frame = feed.publish()
    tenants = frame.gauges["tenants"]
    assert set(tenants) == {"alice", "bob"} and frame.gauges["scheduling_policy"] == "fcfs"
    assert tenants["alice"]["weight"] == 2.0 and tenants["bob"]["blocks_used"] == 4
    assert tenants["bob"]["num_running"] == 1 and tenants["bob"]["tail_name"] == "max"
    json.dumps(frame.header())                # what the widget trait and the comm send: plain JSON
    engine.abort(engine.live_requests()[0].request_id)


class RecordingComm:
    def __init__(self) -> None:
        self.sent, self.handler = [], None

    def on_msg(self, handler):
        self.handler = handler

    def on_close(self, closer):
        self.closer = closer

    def send(self, data, buffers=None):
        self.sent.append(data)


def test_the_widget_the_comm_and_the_snapshot_all_carry_the_tenants(make_engine):
    engine, feed, _ = two_tenants(make_engine)
    engine.add_request(PREFIX, GREEDY, tenant="alice")
    engine.step()
    feed.publish()
    widget = engine.monitor()
    assert {v[0] for v in widget.base["tenants"].values()} == {"alice"}
    assert "alice" in widget.base["gauges"]["tenants"]
    comm = RecordingComm()
    open_comm(comm, {}, get_engine=lambda: engine)
    comm.handler({"content": {"data": {"request": "subscribe", "diffs": True}}})
    sent = comm.sent[0]["tenants"]
    assert sent and all(v == ["alice"] for v in sent.values()) and "alice" in comm.sent[0]["gauges"]["tenants"]
    pool = snapshot(engine)["pool"]
    assert pool["tenants"] and all(isinstance(k, str) for k in pool["tenants"])
    comm.closer({})
    widget.close()
    engine.abort(engine.live_requests()[0].request_id)
