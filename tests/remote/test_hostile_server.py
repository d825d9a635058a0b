"""A hostile or broken server cannot hurt the kernel (remote/wire.py): each thing it may send ends
the request in one RemoteError line, in bounded time and bounded memory, and the client keeps
serving. The server is fake_vllm's, with a scripted answer per prompt."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
import tracemalloc
from http.server import ThreadingHTTPServer

import pytest

from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.remote import wire
from jupyter_pagedkv.remote.client import RemoteError

from fake_vllm import METRICS, FakeServer

MiB = 1 << 20
MEMORY_BOUND = 6 * MiB     # the reader holds at most one line (wire.MAX_LINE, 1 MiB) at a time


def event(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


FIRST = event({"choices": [{"index": 0, "text": "Hello", "token_ids": [1]}], "prompt_token_ids": [5, 6, 7]})
# Built once, before memory is measured: what the server sends is not the client's memory.
SCRIPTS: dict[str, list[bytes]] = {
    "json-list": [FIRST, b"data: [1, 2]\n\n"],
    "choices-text": [FIRST, event({"choices": "abc"})],
    "text-number": [FIRST, event({"choices": [{"index": 0, "text": 5}]})],
    "token-ids-text": [FIRST, event({"choices": [{"index": 0, "text": "a", "token_ids": "xyz"}]})],
    "usage-number": [FIRST, event({"choices": [], "usage": 5})],
    "cached-negative": [FIRST, event({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": -4}}})],
    "huge-index": [FIRST, event({"choices": [{"index": 10 ** 9, "text": "a"}]})],
    "bool-index": [FIRST, event({"choices": [{"index": True, "text": "a"}]})],
    "oversize-line": [FIRST, b"data: " + b"x" * (3 * MiB) + b"\n\n"],
    "endless": [FIRST] + [event({"choices": [{"index": 0, "text": "y" * 4000, "token_ids": [3] * 100}]})] * 4000,
    "truncated": [FIRST, b'data: {"choices": [{"index": 0, "te'],
    "invalid-utf8": [FIRST, b'data: {"choices": [{"index": 0, "text": "\xff\xfe"}]}\n\n'],
}
EXPECTED = {
    "json-list": "an event that is a JSON list", "choices-text": "choices that are not a list",
    "text-number": "text that is not a string", "token-ids-text": "token_ids that are not a list",
    "usage-number": "usage that is not an object", "cached-negative": "cached_tokens that is not a count",
    "huge-index": "choice index 1000000000 \\(asked for 1 choice\\)", "bool-index": "choice index True",
    "oversize-line": "a stream line over 1 MiB", "endless": "streamed over 2 MiB for one request",
    "truncated": "closed the stream in the middle of a line", "invalid-utf8": "not UTF-8",
    "slow-drip": "one stream line for over 1 s \\(a slow drip\\)",
    "reset": "dropped|closed|reset|Connection", "closed-mid-stream": "dropped before the end",
}


class Hostile(FakeServer):
    """Model 'm' as fake_vllm serves it, but a POST's prompt names what goes wrong."""

    key = None
    metrics = METRICS
    version = "fake"
    refuse_salt = None
    bodies: list = []
    salted: set = set()
    models_padding = 0

    def do_GET(self) -> None:
        if self.path == "/v1/models" and self.models_padding:
            self._json(200, {"object": "list", "data": [{"id": "m"}], "pad": "p" * self.models_padding})
            return
        super().do_GET()

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = req.get("prompt")
        if prompt not in SCRIPTS and prompt not in ("slow-drip", "reset", "closed-mid-stream"):
            return self._ok()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            if prompt == "slow-drip":
                self.wfile.write(FIRST)
                for byte in b'data: {"choices": [{"index": 0, "text": "never ends"' * 100:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.1)
            elif prompt == "reset":   # a socket closed with RST in the middle of a line
                self.wfile.write(FIRST + b'data: {"choi')
                self.wfile.flush()
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
            elif prompt == "closed-mid-stream":
                self.wfile.write(FIRST)
            else:
                for piece in SCRIPTS[prompt]:
                    self.wfile.write(piece)
                self.wfile.flush()
        except OSError:
            pass   # the client stopped reading, as it should

    def _ok(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(FIRST + event({"choices": [{"index": 0, "text": " world", "token_ids": [2],
                                                     "finish_reason": "length"}]}) + b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def hostile():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def local():
    """A local engine beside the remote client, as in a notebook that loaded a model and then
    connected to a server: a finished request left cached blocks, a live one holds blocks mid-way."""
    from conftest import hf_greedy, tiny_model

    model, live = tiny_model("llama", seed=5), list(range(40, 55))
    engine = Engine(model, None, block_size=4, num_blocks=32)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.generate([list(range(3, 20))], greedy)
    rid = engine.add_request(live, greedy)
    engine.step()
    yield engine
    while engine.has_unfinished_requests():            # the live request goes on, exactly
        engine.step()
    done = next(r for r in engine._finished if r.request_id == rid)
    assert engine._outputs.output(done).token_ids == hf_greedy(model, live, 6, stop_at_eos=False)
    engine.check_invariants()


def pool_state(engine) -> tuple:
    """Everything about the local pool a misbehaving server could change: each block's references
    and cached hash, the free queue's order, the live requests' tables."""
    pool = engine._pool
    return (pool.ref_counts().tolist(), [b.block_hash for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            {r.request_id: [s.block_table.block_ids for s in r.seqs] for r in engine.live_requests()})


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_each_hostile_answer_is_one_remote_error_line_in_bounded_time_and_memory(hostile, local, case, monkeypatch):
    monkeypatch.setattr(wire, "MAX_STREAM", 2 * MiB)   # the cap, made small enough to reach quickly
    before = pool_state(local)
    client = Engine.connect(hostile, timeout=1.0)
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(RemoteError, match=EXPECTED[case]) as err:
            client.generate(case, SamplingParams(max_tokens=2))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 10
    assert "\n" not in str(err.value)
    assert peak < MEMORY_BOUND, f"{case}: {peak / MiB:.1f} MiB"
    assert not client.live_requests()
    assert client.generate("fine", SamplingParams(max_tokens=2))[0].text == "Hello world"
    client.shutdown()
    assert pool_state(local) == before                 # the local engine's blocks are untouched
    assert local.has_unfinished_requests()
    local.check_invariants()


def test_an_oversize_response_at_connect_is_one_line(hostile, monkeypatch):
    monkeypatch.setattr(Hostile, "models_padding", wire.MAX_BODY + 10)
    with pytest.raises(RemoteError, match="sent a response over 4 MiB"):
        Engine.connect(hostile)


def test_the_client_asks_for_a_bounded_number_of_choices(hostile):
    client = Engine.connect(hostile)
    with pytest.raises(ValueError, match=f"n <= {wire.MAX_CHOICES}"):
        client.generate("fine", SamplingParams(n=10 ** 7))
    assert not client.live_requests()


def test_the_kv_event_map_stays_bounded_and_says_it_evicted(caplog):
    from jupyter_pagedkv.remote.kv_events import BlockMap

    m = BlockMap(max_blocks=100)
    stored = lambda hs: {"type": "BlockStored", "block_hashes": hs, "block_size": 16}   # noqa: E731
    m.apply_batch([0.0, [stored(list(range(1000)))]])
    assert m.num_blocks == 100 and m.num_evicted == 900
    assert set(m.slots) == set(range(900, 1000))          # the newest hashes stay
    assert sorted(m.slots.values()) == list(range(100))   # slots are reused, not grown
    assert sum("evicting the oldest hashes" in r.getMessage() for r in caplog.records) == 1


def test_the_kv_event_socket_refuses_oversize_messages():
    zmq = pytest.importorskip("zmq")
    from jupyter_pagedkv.remote.kv_events import MAX_MESSAGE_BYTES, KVEventListener

    listener = KVEventListener("tcp://127.0.0.1:1")   # nothing listens there: only the option matters
    try:
        assert listener._sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
    finally:
        listener.close()


def test_an_oversize_kv_event_message_is_refused_in_one_line_and_the_next_batch_is_applied(caplog):
    """End to end over ZMQ: a publisher sends a batch, one message over the limit (libzmq refuses
    it unread and gives the connection up), then batches again: the listener says so in one
    line, reconnects, and applies the next batch."""
    zmq = pytest.importorskip("zmq")
    from jupyter_pagedkv.remote.kv_events import MAX_MESSAGE_BYTES, KVEventListener

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    listener = KVEventListener(f"tcp://127.0.0.1:{port}")
    stored = lambda hs: msgpack_batch(hs)   # noqa: E731

    def publish_until(seq: int, hashes: list[int], done) -> None:
        """Publish one batch every 50 ms until `done()` (a subscription takes a moment to reach
        the publisher, which drops what it sends before); fails after 20 s."""
        deadline = time.monotonic() + 20
        while not done():
            assert time.monotonic() < deadline, "the listener never received the batch"
            pub.send_multipart([b"", seq.to_bytes(8, "big"), stored(hashes)])
            time.sleep(0.05)

    try:
        publish_until(1, [11, 12], lambda: listener.snapshot().num_blocks == 2)
        pub.send_multipart([b"", (2).to_bytes(8, "big"), b"\x00" * (MAX_MESSAGE_BYTES + 1)])
        publish_until(3, [13], lambda: listener.snapshot().num_blocks == 3)
        assert listener.error is None and listener.num_reconnects >= 1
        assert "\n" not in listener.last_drop and "over 8 MiB is refused" in listener.last_drop
        assert sum("the connection dropped" in r.getMessage() for r in caplog.records) == listener.num_reconnects
        assert set(listener.snapshot().slots) == {11, 12, 13}   # the refused bytes were never decoded
    finally:
        listener.close()
        pub.close(0)


def msgpack_batch(hashes: list[int]) -> bytes:
    """An EventBatch [ts, [BlockStored]] in msgpack, small ints only (what the listener decodes)."""
    def s(text: str) -> bytes:
        return bytes([0xA0 | len(text)]) + text.encode()
    assert len(hashes) < 16 and all(0 <= h < 128 for h in hashes)
    event = bytes([0x83]) + s("type") + s("BlockStored") + s("block_hashes") + bytes([0x90 | len(hashes)]) \
        + bytes(hashes) + s("block_size") + bytes([16])
    return bytes([0x92, 0x00, 0x91]) + event
