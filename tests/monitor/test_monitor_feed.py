"""The monitor feed and widget, kernel side: diffs that rebuild the pool exactly, bounded in size,
throttled to 10 Hz, gauges that agree with EngineStats, and a deterministic text repr."""
from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.monitor.channel import open_comm
from jupyter_pagedkv.monitor.feed import MonitorFeed, feed_for
from jupyter_pagedkv.notebook.session import KernelSession

MODEL = tiny_model("llama", seed=3)
PROMPT = list(range(3, 30))          # 27 tokens: 6 full blocks of 4 and a partial one
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class Replica:
    """What a front end holds: a full frame, then every diff applied on it in order."""

    def __init__(self) -> None:
        self.frames = []
        self.codes = self.refs = None
        self.owners: dict[int, list[str]] = {}
        self.legend: list[str] = []
        self.seq = None

    def __call__(self, frame) -> None:
        self.frames.append(frame)
        if frame is None:
            return
        if frame.full:
            self.codes, self.refs = frame.codes.copy(), frame.refs.copy()
            self.owners = dict(frame.owners)
        else:
            assert frame.prev == self.seq, "a diff must apply on the frame before it"
            self.codes[frame.ids] = frame.codes
            self.refs[frame.ids] = frame.refs
            for i, owners in frame.owners.items():
                if owners:
                    self.owners[i] = owners
                else:
                    self.owners.pop(i, None)
        self.legend, self.seq = frame.legend, frame.seq

    def states(self) -> list[str]:
        return [self.legend[c] for c in self.codes]


def manual_feed(engine) -> MonitorFeed:
    """The engine's feed without its thread: the test decides when a frame is published."""
    return feed_for(engine, threaded=False)


def assert_matches_engine(replica: Replica, engine) -> None:
    snap = engine.pool_snapshot()
    assert replica.states() == snap["states"]
    assert replica.refs.tolist() == [min(r, 255) for r in snap["ref_counts"]]
    assert replica.owners == {k: sorted(set(v)) for k, v in snap["owners"].items()}


def test_diffs_applied_in_order_rebuild_the_pool_exactly(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    feed = manual_feed(engine)
    replica = Replica()
    feed.subscribe(replica)
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=1, ignore_eos=True))
    engine.add_request(PROMPT[:9], GREEDY)
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        feed.publish()
        assert_matches_engine(replica, engine)
        seen.update(replica.states())
    engine.add_request(PROMPT, GREEDY)          # a prefix hit turns cached blocks back into used
    engine.step()
    feed.publish()
    assert_matches_engine(replica, engine)
    assert {"used", "shared", "cached"} <= seen | set(replica.states())
    assert replica.frames[0].full and replica.frames[0].ids.size == 64


def test_a_diff_carries_only_the_changed_blocks_whatever_the_pool_size(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=4096)
    feed = manual_feed(engine)
    replica = Replica()
    feed.subscribe(replica)
    engine.add_request(PROMPT, GREEDY)
    engine.step()                                # prefill: 7 blocks allocated
    first = feed.publish()
    engine.step()                                # one decode token: at most 1 new block
    second = feed.publish()
    assert replica.frames[0].nbytes >= 6 * 4096  # the full frame is the whole pool
    assert 1 <= len(first.ids) <= 8
    assert len(second.ids) <= 1
    assert first.nbytes <= 6 * len(first.ids) + 16 * len(first.ids) + 64
    assert feed.publish() is None                # nothing changed: nothing sent
    engine.abort(engine.live_requests()[0].request_id)


def test_unchanged_state_sends_nothing_and_an_abort_outside_a_step_is_still_sent(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    feed = manual_feed(engine)
    replica = Replica()
    feed.subscribe(replica)
    rid = engine.add_request(PROMPT, GREEDY)
    engine.step()
    feed.publish()
    assert replica.states().count("used") == 7
    engine.abort(rid)                            # no step: the pool's touched set carries it
    frame = feed.publish()
    assert frame is not None and len(frame.ids) == 7
    assert "used" not in replica.states()
    assert_matches_engine(replica, engine)


def test_updates_are_throttled_to_ten_a_second_while_steps_run_faster(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=512)
    feed = engine.monitor_feed
    stamps: list[float] = []
    replica = Replica()

    def receive(frame):
        stamps.append(time.monotonic())
        replica(frame)

    token = feed.subscribe(receive)
    engine.start()
    steps0 = engine.num_steps
    t0 = time.monotonic()
    engine.generate([PROMPT] * 4, SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    elapsed = time.monotonic() - t0
    deadline = time.monotonic() + 60              # the trailing frame after the last step: the feed
    while "used" in replica.states() and time.monotonic() < deadline:   # thread sends it within
        time.sleep(0.01)                          # its throttle, if the machine lets it run
    steps = engine.num_steps - steps0
    feed.unsubscribe(token)
    gaps = np.diff(stamps[1:])
    assert len(stamps) - 1 <= elapsed / 0.1 + 3
    assert gaps.size == 0 or gaps.min() >= 0.09
    # Never more than a frame per step (a fast machine folds many steps into one frame; how many
    # depends on its speed, so only the bounds above and this one are asserted).
    assert len(stamps) - 1 <= steps + 2, (steps, len(stamps))
    assert "used" not in replica.states()        # the final state was sent
    assert_matches_engine(replica, engine)
    assert feed._thread is None and not engine._step_listeners   # no cost once nobody watches


def test_gauges_agree_with_engine_stats(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    feed = manual_feed(engine)
    feed.subscribe(Replica())
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=5, temperature=0.7, seed=2, ignore_eos=True))
    engine.add_request(PROMPT[:10], GREEDY)
    keys = ("num_free", "num_used", "num_cached", "num_shared", "tokens_stored", "slots_allocated",
            "internal_waste", "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits")
    for _ in range(4):
        engine.step()
        frame = feed.publish()
        stats = engine.stats()
        assert {k: frame.gauges[k] for k in keys} == {k: getattr(stats, k) for k in keys}
        assert frame.gauges["kv_cache_usage"] == pytest.approx(stats.kv_cache_usage)
    for req in engine.live_requests():
        engine.abort(req.request_id)


def test_the_gauges_carry_the_speculation_counters(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64, speculative="ngram")
    feed = manual_feed(engine)
    feed.subscribe(Replica())
    engine.generate([list(range(3, 13)) * 4], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    frame = feed.publish()
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 0
    assert (frame.gauges["spec_proposed_tokens"], frame.gauges["spec_accepted_tokens"]) == (
        stats.spec_proposed_tokens, stats.spec_accepted_tokens)
    assert frame.gauges["spec_acceptance_rate"] == pytest.approx(stats.spec_acceptance_rate)
    assert frame.gauges["spec_mean_accepted_length"] == pytest.approx(stats.spec_mean_accepted_length)


def test_a_state_the_feed_has_never_seen_gets_a_new_legend_entry(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=8)
    feed = manual_feed(engine)
    snap = engine.pool_snapshot([2, 5])
    snap["states"] = ["speculative", "beam-candidate"]
    changed = feed._compare(snap, snap["block_ids"])
    assert changed == [2, 5]
    assert feed.legend[feed.codes[2]] == "speculative"
    assert feed.legend[feed.codes[5]] == "beam-candidate" and feed.legend[-1] == "beam-candidate"


def test_the_widget_repr_is_deterministic_and_its_traits_carry_base_and_diffs(make_engine):
    pytest.importorskip("anywidget")
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    manual_feed(engine)
    one, two = engine.monitor(), engine.monitor()
    expected = f"BlockPoolMonitor({engine.name!r}: 64 blocks × 4 tokens)"
    assert repr(one) == repr(two) == expected
    assert one._repr_mimebundle_()[0]["text/plain"] == expected
    assert one.base["full"] is True and len(one.base["codes"]) == 64
    engine.add_request(PROMPT, GREEDY)
    engine.step()
    engine.monitor_feed.publish()
    assert one.frame["prev"] == one.base["seq"] and not one.frame["full"]
    assert len(one.frame["ids"]) == 4 * len(one.frame["codes"]) == 4 * 7
    one._on_request(one, {"request": "resync"}, [])            # a view that missed a diff
    assert one.base["seq"] == one.frame["seq"]
    one.close()
    two.close()
    assert engine.monitor_feed.num_subscribers == 0
    engine.abort(engine.live_requests()[0].request_id)


def test_while_diffs_flow_base_is_refreshed_every_few_seconds(make_engine, monkeypatch):
    """A view drawn anew during a long cell cannot have its resync answered before the cell ends:
    every BASE_REFRESH_S the pool goes out as `base`, so such a view is never staler than that."""
    pytest.importorskip("anywidget")
    from jupyter_pagedkv.widgets import block_pool_monitor

    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    feed = manual_feed(engine)
    monitor = engine.monitor()
    clock = [1000.0]
    monkeypatch.setattr(block_pool_monitor.time, "monotonic", lambda: clock[0])
    monitor._base_at = clock[0]
    engine.add_request(PROMPT, GREEDY)
    engine.step()
    feed.publish()
    assert monitor.frame["seq"] == feed.seq and monitor.base["seq"] < feed.seq    # a diff
    clock[0] += block_pool_monitor.BASE_REFRESH_S
    engine.step()
    feed.publish()
    assert monitor.base["seq"] == feed.seq > monitor.frame["seq"]                    # the pool, whole
    assert bytes(monitor.base["codes"]) == bytes(feed.full_frame().codes)
    engine.step()
    feed.publish()
    assert monitor.frame["seq"] == feed.seq == monitor.base["seq"] + 1               # diffs again
    monitor.close()
    engine.abort(engine.live_requests()[0].request_id)


def test_shutting_the_engine_down_tells_the_monitors(make_engine):
    pytest.importorskip("anywidget")
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    widget = engine.monitor()
    replica = Replica()
    engine.monitor_feed.subscribe(replica)
    engine.shutdown()
    assert replica.frames[-1] is None and widget.frame == {"closed": True}
    with pytest.raises(ValueError, match="at least 40"):
        from jupyter_pagedkv.widgets import BlockPoolMonitor
        BlockPoolMonitor(engine, height=10)


class BufferComm:
    def __init__(self) -> None:
        self.sent: list[tuple[dict, list]] = []

    def on_msg(self, f):
        self.handler = f
        return f

    def on_close(self, f):
        self.closer = f

    def send(self, data, buffers=None):
        self.sent.append((data, buffers or []))


def test_the_comm_subscribes_to_the_same_feed_and_sends_binary_diffs(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    manual_feed(engine)
    session = KernelSession(engine=engine)
    comm = BufferComm()
    open_comm(comm, {}, get_engine=lambda: session.engine)
    comm.handler({"content": {"data": {"request": "subscribe", "diffs": True}}})
    data, buffers = comm.sent[0]
    assert data["response"] == "frame" and data["full"] and data["loaded"] and data["model"] == engine.name
    assert data["buffers"] == ["ids", "codes", "refs"] and [len(b) for b in buffers] == [256, 64, 64]
    engine.add_request(PROMPT, GREEDY)
    engine.step()
    engine.monitor_feed.publish()
    data, buffers = comm.sent[-1]
    assert data["prev"] == comm.sent[0][0]["seq"] and len(buffers[1]) == 7
    comm.closer({})
    assert engine.monitor_feed.num_subscribers == 0
    empty = BufferComm()
    open_comm(empty, {}, get_engine=lambda: None)
    empty.handler({"content": {"data": {"request": "subscribe", "diffs": True}}})
    assert empty.sent == [({"response": "frame", "loaded": False}, [])]
    engine.abort(engine.live_requests()[0].request_id)


def test_a_periodic_full_scan_catches_states_the_pool_did_not_record(make_engine, monkeypatch):
    engine = make_engine(MODEL, block_size=4, num_blocks=16)
    feed = MonitorFeed(engine, threaded=False, resync_interval=0.0)
    replica = Replica()
    feed.subscribe(replica)
    real = engine.observe

    def marking_block_9(full=False):          # as a feature that flags blocks without a ref change
        obs = real(full)
        if full:
            obs.snapshot["states"][9] = "speculative"
        return obs

    monkeypatch.setattr(engine, "observe", marking_block_9)
    rid = engine.add_request(PROMPT[:5], GREEDY)
    engine.step()
    feed.publish()
    assert replica.states()[9] == "speculative"
    engine.abort(rid)


def test_the_widget_also_leaves_a_still_image_for_pages_where_no_widget_runs(make_engine):
    """GitHub, nbviewer and exports show the image/png of the bundle: the pool at display time."""
    import base64
    import io

    pytest.importorskip("anywidget")
    from matplotlib.image import imread

    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    manual_feed(engine)
    engine.add_request(PROMPT, GREEDY)
    engine.step()
    monitor = engine.monitor()
    data = monitor._repr_mimebundle_()[0]
    png = base64.b64decode(data["image/png"])
    assert png.startswith(b"\x89PNG") and "application/vnd.jupyter.widget-view+json" in data
    pixels = imread(io.BytesIO(png))[..., :3]
    used = np.array([0, 158, 115]) / 255                       # blockmap.js's "used"
    assert (np.abs(pixels - used).max(axis=-1) < 0.02).sum() > 50, "no used block in the still image"
    monitor.close()
    engine.abort(engine.live_requests()[0].request_id)
    big = make_engine(MODEL, block_size=4, num_blocks=5000)
    manual_feed(big)
    wide = big.monitor()
    assert wide.still_png() is None and "image/png" not in wide._repr_mimebundle_()[0]
    wide.close()


def test_the_still_image_is_refreshed_to_the_busiest_moment_after_a_cell(make_engine, monkeypatch):
    """A monitor shown before the cells that fill the pool is saved showing their busiest moment,
    captioned with the cell, not the empty pool it saw when it was displayed."""
    from types import SimpleNamespace

    import IPython.display

    pytest.importorskip("anywidget")
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    feed = manual_feed(engine)
    monitor = engine.monitor()

    class Handle:
        def __init__(self, data, metadata=None, **_):
            self.data, self.metadata = data, metadata

        def update(self, data, metadata=None, **_):
            self.data, self.metadata = data, metadata

    shown: list[Handle] = []
    monkeypatch.setattr(IPython.display, "display", lambda data, **kw: shown.append(Handle(data, **kw)) or shown[-1])
    monitor._ipython_display_()
    assert shown[0].metadata["jupyter_pagedkv"] == {"still": "at display time", "blocks_in_use": 0,
                                                    "blocks_cached": 0}
    engine.add_request(PROMPT, GREEDY)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        feed.publish()
        peak = max(peak, engine.stats().num_used)
    base_before = monitor.base["seq"]
    monitor._refresh_still(SimpleNamespace(execution_count=7))
    # The update re-renders the live views from `base`: it must be the pool now, not the pool at
    # display time (a fast browser drew the empty pool for a moment after every such cell).
    assert monitor.base["seq"] == feed.seq > base_before
    assert bytes(monitor.base["codes"]) == bytes(feed.full_frame().codes)
    meta = shown[0].metadata["jupyter_pagedkv"]
    assert meta["blocks_in_use"] == peak > 0 and "cell [7]" in meta["still"]
    assert "application/vnd.jupyter.widget-view+json" in shown[0].data and "image/png" in shown[0].data
    monitor._refresh_still(SimpleNamespace(execution_count=8))     # no busier moment: left as it was
    assert "cell [7]" in shown[0].metadata["jupyter_pagedkv"]["still"]
    monitor.close()
