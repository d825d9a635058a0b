"""A live block map of a vLLM server, rebuilt from the KV-cache events it publishes over ZMQ.

vLLM (`--kv-events-config`) publishes, after each engine step, a msgpack `EventBatch`
`[ts, [event, ...], dp_rank?]` whose events are maps tagged by `type`: `BlockStored` (full blocks
that entered the prefix cache, by hash), `BlockRemoved` (hashes evicted) and `AllBlocksCleared`.
Only full, hashed blocks are published, and without their physical ids or reference counts, so the
map here is our own layout: one slot per stored hash, freed slots reused, in arrival order.

msgpack is decoded by a small reader below (no msgpack package in our dependencies); pyzmq comes
with Jupyter's kernel and is imported only when a listener starts.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# A server's prefix cache holds at most its pool; a map past this many hashes (far more than any
# real pool shown in one widget) drops its oldest hashes instead of growing without bound.
MAX_MAP_BLOCKS = 1 << 18
# One ZMQ message (one EventBatch) of more than this is refused by the socket itself, before it is
# read into memory; libzmq then closes that connection for good, so the listener reconnects.
MAX_MESSAGE_BYTES = 8 << 20


class MsgpackError(ValueError):
    """The payload is not the msgpack we expect (truncated or an unknown type byte)."""


def unpack_msgpack(data: bytes) -> Any:
    """Decode one msgpack value (the subset vLLM's encoder emits: no ext types but timestamps)."""
    value, end = _read(memoryview(data), 0)
    if end != len(data):
        raise MsgpackError(f"{len(data) - end} trailing bytes after the msgpack value")
    return value


def _read(buf: memoryview, i: int) -> tuple[Any, int]:
    if i >= len(buf):
        raise MsgpackError("truncated msgpack payload")
    b = buf[i]
    i += 1
    if b <= 0x7F:
        return b, i
    if b >= 0xE0:
        return b - 0x100, i
    if 0x80 <= b <= 0x8F:
        return _map(buf, i, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _array(buf, i, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        return _str(buf, i, b & 0x1F)
    simple = {0xC0: None, 0xC2: False, 0xC3: True}
    if b in simple:
        return simple[b], i
    fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
             0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
    if b in fixed:
        fmt = fixed[b]
        size = struct.calcsize(fmt)
        _need(buf, i, size)
        return struct.unpack_from(fmt, buf, i)[0], i + size
    lengths = {0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"),
               0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"),
               0xDC: (">H", "array"), 0xDD: (">I", "array"), 0xDE: (">H", "map"), 0xDF: (">I", "map")}
    if b in lengths:
        fmt, kind = lengths[b]
        size = struct.calcsize(fmt)
        _need(buf, i, size)
        n = struct.unpack_from(fmt, buf, i)[0]
        i += size
        if kind == "bin":
            _need(buf, i, n)
            return bytes(buf[i:i + n]), i + n
        return {"str": _str, "array": _array, "map": _map}[kind](buf, i, n)
    raise MsgpackError(f"unsupported msgpack type byte 0x{b:02x}")


def _need(buf: memoryview, i: int, n: int) -> None:
    if i + n > len(buf):
        raise MsgpackError("truncated msgpack payload")


def _str(buf: memoryview, i: int, n: int) -> tuple[str, int]:
    _need(buf, i, n)
    return bytes(buf[i:i + n]).decode("utf-8"), i + n


def _array(buf: memoryview, i: int, n: int) -> tuple[list, int]:
    out = []
    for _ in range(n):
        v, i = _read(buf, i)
        out.append(v)
    return out, i


def _map(buf: memoryview, i: int, n: int) -> tuple[dict, int]:
    out = {}
    for _ in range(n):
        k, i = _read(buf, i)
        v, i = _read(buf, i)
        out[_hashable(k)] = v
    return out, i


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


@dataclass
class BlockMap:
    """The server's prefix-cached blocks as events report them: hash -> our slot number."""

    slots: dict[Any, int] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    next_slot: int = 0
    num_stored_events: int = 0
    num_removed_events: int = 0
    unknown_removed: int = 0      # removals of hashes stored before we subscribed
    num_batches: int = 0
    missed_batches: int = 0       # gaps in the publisher's sequence numbers
    last_seq: int | None = None
    block_size: int | None = None
    num_evicted: int = 0          # oldest hashes dropped to keep the map within max_blocks
    max_blocks: int = MAX_MAP_BLOCKS

    @property
    def num_blocks(self) -> int:
        """Full blocks the server holds in its prefix cache (in use or reusable)."""
        return len(self.slots)

    def apply_batch(self, batch: Any, seq: int | None = None) -> None:
        """Fold one decoded EventBatch into the map."""
        if seq is not None:
            if self.last_seq is not None and seq > self.last_seq + 1:
                self.missed_batches += seq - self.last_seq - 1
            self.last_seq = seq
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise MsgpackError(f"not a KV event batch: {str(batch)[:80]}")
        self.num_batches += 1
        for event in batch[1]:
            self.apply(event)

    def apply(self, event: Any) -> None:
        kind, body = _event_kind(event)
        if kind == "BlockStored":
            self.num_stored_events += 1
            if body.get("block_size"):
                self.block_size = int(body["block_size"])
            for h in body.get("block_hashes") or []:
                h = _hashable(h)
                if h not in self.slots:
                    if len(self.slots) >= self.max_blocks:
                        self._evict_oldest()
                    self.slots[h] = self.free_slots.pop() if self.free_slots else self._new_slot()
        elif kind == "BlockRemoved":
            self.num_removed_events += 1
            for h in body.get("block_hashes") or []:
                slot = self.slots.pop(_hashable(h), None)
                if slot is None:
                    self.unknown_removed += 1
                else:
                    self.free_slots.append(slot)
        elif kind == "AllBlocksCleared":
            self.slots.clear()
            self.free_slots.clear()
            self.next_slot = 0

    def _evict_oldest(self) -> None:
        """Drop the hash stored longest ago (dicts keep insertion order: O(1)); warn once."""
        if not self.num_evicted:
            logger.warning("the KV-event block map reached %d blocks: evicting the oldest hashes "
                           "(the server's map is shown in part)", self.max_blocks)
        self.free_slots.append(self.slots.pop(next(iter(self.slots))))
        self.num_evicted += 1

    def _new_slot(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1


def _event_kind(event: Any) -> tuple[str, dict]:
    """msgspec tags events with `type` in a map; array-encoded events put the tag first."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                 "BlockRemoved": ("block_hashes",)}
        keys = names.get(event[0], ())
        return event[0], dict(zip(keys, event[1:]))
    return "", {}


class KVEventListener:
    """Subscribes to a vLLM KV-event endpoint on a daemon thread and keeps a `BlockMap` current."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        try:
            import zmq
        except ImportError:
            raise ValueError("KV events need pyzmq: `pip install pyzmq` (it comes with ipykernel)") from None
        self.endpoint = endpoint
        self.topic = topic
        self.map = BlockMap()
        self.error: str | None = None
        self.num_reconnects = 0            # connections dropped (an oversize message, a restart)
        self.last_drop: str | None = None  # the one line said about the latest drop
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)   # larger: the peer is dropped
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True, name="pagedkv-kv-events")
        self._thread.start()

    def _run(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._monitor in ready:
                    self._monitor.recv_multipart()   # only EVENT_DISCONNECTED is monitored
                    self._reconnect()
                if self._sock not in ready:
                    continue
                parts = self._sock.recv_multipart()
                # [topic, 8-byte big-endian sequence number, payload]; tolerate a missing topic.
                payload = parts[-1]
                seq = int.from_bytes(parts[-2], "big") if len(parts) >= 2 and len(parts[-2]) == 8 else None
                batch = unpack_msgpack(payload)
                with self._lock:
                    self.map.apply_batch(batch, seq)
        except Exception as err:   # a bad payload stops the map; stats say why
            self.error = f"KV events from {self.endpoint} stopped: {err}"
            logger.warning("%s", self.error, exc_info=True)
        finally:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)

    def _reconnect(self) -> None:
        """The publisher's connection dropped: a message over MAX_MESSAGE_BYTES (libzmq refuses
        it and gives the connection up for good) or the server went away. Say so in one line and
        connect again (a server that is gone is retried by libzmq); batches sent meanwhile are
        missed (`missed_batches` counts the gap)."""
        import zmq
        self.num_reconnects += 1
        self.last_drop = (f"KV events from {self.endpoint}: the connection dropped (a message over "
                          f"{MAX_MESSAGE_BYTES >> 20} MiB is refused, or the server restarted); reconnecting")
        logger.warning("%s", self.last_drop)
        try:
            self._sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass   # libzmq already dropped the endpoint (after a refused message it does)
        self._sock.connect(self.endpoint)
    def snapshot(self) -> BlockMap:
        """A copy, consistent at one moment (the listener keeps updating the original)."""
        with self._lock:
            m = self.map
            return BlockMap(dict(m.slots), list(m.free_slots), m.next_slot, m.num_stored_events,
                            m.num_removed_events, m.unknown_removed, m.num_batches, m.missed_batches,
                            m.last_seq, m.block_size, m.num_evicted, m.max_blocks)

    def wait_quiet(self, quiet_s: float = 0.5, timeout: float = 10.0) -> None:
        """Wait until no batch arrived for `quiet_s` (events trail the server's steps)."""
        deadline = time.monotonic() + timeout
        last = -1
        while time.monotonic() < deadline:
            with self._lock:
                n = self.map.num_batches
            if n == last:
                return
            last = n
            time.sleep(quiet_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
