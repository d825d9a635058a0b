"""One gauge computation: at one instant, `Engine.stats()`, the monitor feed's frame (what the
notebook widget draws), the comm channel's frames (what the JupyterLab panel draws), its snapshot
reply and `%pagedkv status` all show the same numbers."""
from __future__ import annotations

import dataclasses

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.monitor.channel import open_comm, snapshot
from jupyter_pagedkv.monitor.feed import feed_for, gauges
from jupyter_pagedkv.notebook.session import KernelSession


class BufferComm:
    def __init__(self) -> None:
        self.sent, self.handler = [], None

    def send(self, data, buffers=None):
        self.sent.append(data)

    def on_msg(self, fn):
        self.handler = fn

    def on_close(self, fn):
        pass


def busy_engine(make_engine):
    """An engine stopped mid-run: requests running and waiting, shared and cached blocks, finished
    requests with latencies, and a partly filled block in every running sequence."""
    engine = make_engine(tiny_model("llama", seed=5), block_size=4, num_blocks=48, max_num_seqs=3)
    shared = list(range(3, 23))
    done = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([shared + [30], list(range(100, 117))], done)    # the second stays cached
    for i in range(5):
        engine.add_request(shared + [40 + i] * (i + 1),
                           SamplingParams(max_tokens=9, temperature=0.8, seed=i, n=2 if i == 0 else 1,
                                          ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


def test_every_view_shows_the_engines_own_stats(make_engine, capsys):
    engine = busy_engine(make_engine)
    stats = engine.stats()
    # The instant is interesting: every kind of gauge is non-trivial.
    assert stats.num_running and stats.num_waiting and stats.num_shared and stats.num_cached
    assert stats.internal_waste and stats.prefix_cache_hits and stats.latency_percentiles

    feed = feed_for(engine, threaded=False)
    frames = []
    feed.subscribe(frames.append)
    assert frames[0].gauges == gauges(stats)                        # the widget's full frame
    comm = BufferComm()
    open_comm(comm, {}, get_engine=lambda: engine)
    comm.handler({"content": {"data": {"request": "subscribe", "diffs": True}}})
    assert comm.sent[0]["gauges"] == gauges(stats)                  # the JupyterLab panel's frame
    assert snapshot(engine)["stats"] == gauges(stats)               # the comm's snapshot reply
    assert gauges(stats) == {**dataclasses.asdict(stats), "prefix_hit_rate": stats.prefix_hit_rate}

    from IPython.testing.globalipapp import get_ipython, start_ipython

    from jupyter_pagedkv.notebook import session
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "jupyter_pagedkv")
    saved, session._current = session._current, KernelSession(engine=engine)
    try:
        capsys.readouterr()
        ip.run_line_magic("pagedkv", "status")
        printed = capsys.readouterr().out
    finally:
        session._current = saved
    assert stats.summary() in printed                               # %pagedkv status
    assert (f"blocks: {stats.num_used} used ({stats.num_shared} shared), {stats.num_cached} cached"
            in printed)
    assert engine.stats() == stats                                  # nothing moved meanwhile
