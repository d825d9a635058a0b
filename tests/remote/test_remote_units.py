"""The server client without a server: a tiny fake OpenAI-compatible HTTP server (fake_vllm.py) for
its error paths (auth, wrong model, unreachable, timeout, dropped stream), the Prometheus and
msgpack readers, and the KV-event block map. The real vLLM server is exercised in test_remote_vllm.py."""
from __future__ import annotations

import struct
import time

import pytest
from IPython.core.error import UsageError

from jupyter_pagedkv import Engine
from jupyter_pagedkv.remote.kv_events import BlockMap, MsgpackError, unpack_msgpack
from jupyter_pagedkv.remote.client import RemoteError
from jupyter_pagedkv.monitor.feed import MonitorFeed
from jupyter_pagedkv.core.sampling_params import SamplingParams
from jupyter_pagedkv.remote.server_metrics import KV_USAGE, PREFIX_HITS, ServerMetrics, parse_prometheus

from fake_vllm import METRICS, fake, magic_shell  # noqa: F401  (fake, magic_shell: fixtures)

def test_generate_stream_and_usage(fake):
    _, url = fake
    client = Engine.connect(url + "/v1")
    out = client.generate("ok", SamplingParams(max_tokens=2))[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("Hello world", [1, 2], "length")
    assert out.prompt_token_ids == [5, 6, 7] and out.num_cached_tokens == 2
    assert out.metrics.num_generated_tokens == 2 and out.metrics.ttft is not None
    assert [d.text for d in client.stream("ok")] == ["Hello", " world", ""]
    client.check_invariants()
    assert not client.live_requests()


def test_one_line_errors(fake, monkeypatch):
    for name in ("VLLM_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    handler, url = fake
    with pytest.raises(RemoteError, match=r"model 'nope' is not served .* it serves m; pass --model m"):
        Engine.connect(url, model="nope")
    handler.key = "sekret"
    with pytest.raises(RemoteError, match=r"HTTP 401, unauthorized\): set VLLM_API_KEY to the server's key"):
        Engine.connect(url)
    with pytest.warns(UserWarning), pytest.raises(RemoteError, match=r"check the API key from the notebook"):
        Engine.connect(url, api_key="wrong")
    assert Engine.connect(url, api_key="sekret").model == "m"
    port = url.rsplit(":", 1)[1]
    with pytest.raises(RemoteError, match="connection refused; is the server running"):
        Engine.connect("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="not a server URL"):
        Engine.connect("ftp://x:" + port)


def test_dropped_and_stalled_streams_end_the_request(fake):
    """A dropped stream is an error at once; a stalled one (the server sends nothing more until the
    client leaves) ends at the client's timeout, the one thing that can end it."""
    _, url = fake
    patient, impatient = Engine.connect(url, timeout=600.0), Engine.connect(url, timeout=1.0)
    with pytest.raises(RemoteError, match="dropped before the end .* output so far is kept"):
        patient.generate("drop")
    with pytest.raises(RemoteError, match=r"did not answer while streaming within 1 s"):
        impatient.generate("hang")
    failed = [*patient.finished_requests, *impatient.finished_requests]
    assert [r.finish[0] for r in failed] == ["error", "error"]
    assert failed[0].texts[0] == "Hello world"
    assert not patient.live_requests() and not impatient.live_requests()


@pytest.mark.parametrize("prompt, message", [
    ("fail500", r"answered HTTP 500: CUDA error: an illegal memory access was encountered"),
    ("garbled", r"sent an event that is not JSON: not an OpenAI-compatible stream; the output so far is kept"),
    ("error-event", r"failed the request: engine dead: EngineCore encountered an issue"),
])
def test_a_server_failing_mid_stream_is_one_line_and_the_client_keeps_serving(fake, prompt, message):
    _, url = fake
    client = Engine.connect(url, timeout=5.0)
    with pytest.raises(RemoteError, match=message) as info:
        client.generate(prompt)
    assert "\n" not in str(info.value)
    failed = client.finished_requests[-1]
    assert failed.finish[0] == "error" and failed.error is info.value
    assert client.generate("ok")[0].text == "Hello world"
    assert not client.live_requests()


def test_bad_prompts_and_messages_are_refused_before_anything_is_sent(fake):
    _, url = fake
    client = Engine.connect(url)
    for bad, message in [(lambda: client.add_request([5, -1]), "non-negative integers"),
                         (lambda: client.add_request([]), "non-empty list"),
                         (lambda: client.generate(["ok", "   "]), "empty prompt"),
                         (lambda: client.chat([{"role": "user"}]), "no text content"),
                         (lambda: client.chat([{"role": "robot", "content": "hi"}]), "role 'robot'"),
                         (lambda: client.add_request("ok", SamplingParams(stop_token_ids=[-3])), "stop_token_ids")]:
        with pytest.raises(ValueError, match=message):
            bad()
    assert not client.live_requests()


def test_abort_closes_the_stream(fake):
    _, url = fake
    client = Engine.connect(url, timeout=600.0)
    rid = client.add_request("hang")   # cannot end before the abort: the server waits for the client
    time.sleep(0.3)                   # usually streaming by now; an abort before the connect ends it too
    assert client.abort(rid)
    req = client.finished_requests[-1]
    assert req.error is None and req.finish[0] == "abort"
    req.thread.join(600)              # shutting the socket unblocks the reader: its thread ends
    assert not req.thread.is_alive()
    assert not client.abort(rid)


def test_magics_connect_generate_disconnect(fake, magic_shell, capsys):
    from jupyter_pagedkv.notebook import session

    _, url = fake
    ip = magic_shell
    with pytest.raises(UsageError, match="cannot connect: model 'x' is not served"):
        ip.run_line_magic("pagedkv", f"connect {url} --model x")
    with pytest.raises(UsageError, match="e.g. %pagedkv connect"):
        ip.run_line_magic("pagedkv", "connect")
    ip.run_line_magic("pagedkv", f"connect {url} --timeout 1")
    assert "connected to m @" in capsys.readouterr().out
    ip.run_cell_magic("generate", "--max-tokens 2 --raw", "ok")
    out = capsys.readouterr().out
    assert "Hello world" in out and "2/3 prompt tokens cached" in out
    with pytest.raises(UsageError, match="dropped before the end"):
        ip.run_cell_magic("generate", "--max-tokens 2 --raw", "drop")
    ip.run_line_magic("pagedkv", "status")
    assert "KV usage 25.0%" in capsys.readouterr().out
    from jupyter_pagedkv.monitor.channel import snapshot
    snap = snapshot(session.current().engine)   # the monitor comm's payload, unchanged shape
    assert snap["device"] == "remote" and snap["stats"]["num_used"] == 25
    assert snap["pool"]["states"].count("used") == 25 and len(snap["pool"]["states"]) == 100
    ip.run_line_magic("pagedkv", "monitor")
    assert "legend" in capsys.readouterr().out
    ip.run_line_magic("pagedkv", "requests")
    table = capsys.readouterr().out
    assert "remote-0  generate  done (length)  3" in table and "remote-1  generate  failed" in table
    ip.run_line_magic("pagedkv", "disconnect")
    assert "no local model loaded" in capsys.readouterr().out
    assert session.current().engine is None


def test_prometheus_stats(fake):
    _, url = fake
    m = ServerMetrics(parse_prometheus(METRICS), "m")
    assert m.value(KV_USAGE) == 0.25 and m.value(PREFIX_HITS) == 64.0
    s = Engine.connect(url).stats()
    assert (s.num_blocks, s.block_size, s.num_used, s.num_running, s.num_waiting) == (100, 32, 25, 3, 1)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions, s.num_finished) == (200, 64, 2, 10)
    assert "KV events: off" in s.summary()


def test_msgpack_reader():
    assert unpack_msgpack(b"\x93\x01\xcc\xff\xd0\xfe") == [1, 255, -2]
    assert unpack_msgpack(b"\x82\xa4type\xabBlockStored\xa1x\xc0") == {"type": "BlockStored", "x": None}
    assert unpack_msgpack(b"\xcb" + struct.pack(">d", 1.5)) == 1.5
    assert unpack_msgpack(b"\xc4\x02ab") == b"ab"
    assert unpack_msgpack(b"\xcf" + (2**63 + 5).to_bytes(8, "big")) == 2**63 + 5
    with pytest.raises(MsgpackError, match="truncated"):
        unpack_msgpack(b"\x93\x01")
    with pytest.raises(MsgpackError, match="trailing"):
        unpack_msgpack(b"\x01\x02")


def test_block_map_from_events():
    m = BlockMap()
    stored = lambda hs: {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None,
                         "token_ids": [], "block_size": 32}
    m.apply_batch([0.0, [stored([1, 2, 3]), stored([b"\x04"])]], seq=0)
    assert m.num_blocks == 4 and m.block_size == 32
    m.apply_batch([0.1, [{"type": "BlockRemoved", "block_hashes": [2, 99]}]], seq=2)
    assert m.num_blocks == 3 and m.unknown_removed == 1 and m.missed_batches == 1
    m.apply(stored([5]))
    assert m.slots[5] == 1   # the freed slot is reused
    m.apply({"type": "AllBlocksCleared"})
    assert m.num_blocks == 0
    with pytest.raises(MsgpackError):
        m.apply_batch({"not": "a batch"})


def test_monitor_feed_and_widget_follow_the_server(fake):
    """The live monitor of a client: the local feed's frames, polled from /metrics (no KV events
    here, so the map is the usage gauge's count of used blocks)."""
    handler, url = fake
    client = Engine.connect(url)
    feed = MonitorFeed(client, threaded=False, resync_interval=0.0)
    frames = []
    token = feed.subscribe(frames.append)
    first = frames[0]
    assert first.full and (first.num_blocks, first.block_size) == (100, 32)
    assert first.gauges["num_used"] == 25 and first.gauges["num_running"] == 3
    assert first.gauges["prefix_hit_rate"] == 64 / 200
    handler.metrics = (METRICS.replace("usage_perc{engine=\"0\",model_name=\"m\"} 0.25",
                                       "usage_perc{engine=\"0\",model_name=\"m\"} 0.5")
                       .replace("running{engine=\"0\",model_name=\"m\"} 3.0",
                                "running{engine=\"0\",model_name=\"m\"} 7.0"))
    diff = feed.publish()
    assert diff is frames[-1] and diff.prev == first.seq and not diff.full
    assert diff.ids.tolist() == list(range(25, 50))           # only the newly used blocks travel
    assert diff.gauges["kv_cache_usage"] == 0.5 and diff.gauges["num_running"] == 7
    feed.unsubscribe(token)
    widget = client.monitor()                                  # the client's own shared feed
    assert repr(widget) == f"BlockPoolMonitor('m @ {url}': 100 blocks × 32 tokens)"
    assert widget.base["gauges"]["num_used"] == 50
    widget.close()
    client.shutdown()
    assert client.monitor_feed.num_subscribers == 0


def test_processor_parameters_travel_under_vllms_names(fake):
    handler, url = fake
    client = Engine.connect(url + "/v1")
    client.generate("ok", SamplingParams(max_tokens=2, repetition_penalty=1.2, presence_penalty=0.5,
                                         frequency_penalty=-0.5, min_tokens=1, logit_bias={7: -3.0},
                                         allowed_token_ids=[1, 2, 7], bad_words=["no"],
                                         include_stop_str_in_output=True, skip_special_tokens=False))
    body = handler.bodies[-1]
    assert {k: body[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                                 "logit_bias", "allowed_token_ids", "bad_words", "include_stop_str_in_output",
                                 "skip_special_tokens")} == dict(
        repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=1, logit_bias={"7": -3.0},
        allowed_token_ids=[1, 2, 7], bad_words=["no"], include_stop_str_in_output=True, skip_special_tokens=False)
    client.generate("ok", SamplingParams(max_tokens=2))
    assert not {"repetition_penalty", "min_tokens", "bad_words", "logit_bias"} & set(handler.bodies[-1])
    with pytest.raises(ValueError, match="bad_words as text only"):
        client.add_request("ok", SamplingParams(bad_words=[[3, 4]]))


def test_structured_outputs_travel_as_vllms_structured_outputs_object(fake):
    from pydantic import BaseModel

    from jupyter_pagedkv import StructuredOutputsParams

    class City(BaseModel):
        name: str

    handler, url = fake
    client = Engine.connect(url + "/v1")
    for spec, sent in ((StructuredOutputsParams(json=City), {"json": City.model_json_schema()}),
                       (StructuredOutputsParams(choice=("a", "b")), {"choice": ["a", "b"]}),
                       (StructuredOutputsParams(regex="[0-9]+"), {"regex": "[0-9]+"}),
                       (StructuredOutputsParams(grammar='root ::= "x"'), {"grammar": 'root ::= "x"'})):
        client.generate("ok", SamplingParams(max_tokens=2, structured_outputs=spec))
        assert handler.bodies[-1]["structured_outputs"] == sent
    client.generate("ok", SamplingParams(max_tokens=2))
    assert "structured_outputs" not in handler.bodies[-1]
