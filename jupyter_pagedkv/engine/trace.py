"""The workload trace: what `engine.record()` writes and `%pagedkv replay` reads (JSON Lines).

Line 1 is a header: `{"format": "jupyter-pagedkv-trace", "version": 1, "model", "revision",
"block_size", "vocab_size", "keeps_prompts", "config": {EngineConfig}, "tenants": {...}}`; every
other line is one request (`TraceRequest`, its fields by name). Arrivals are in seconds from the
start of the recording and in engine steps (steps completed before the request was added), so a
replay can run on the step clock and give the same schedule on any machine.

Privacy: by default no token id is written. A prompt is kept as its length and the chained hashes
of its full blocks (`block_hashes`, BLAKE2b keyed with a random key that is never written), plus
one hash of the whole prompt (`prompt_hash`). Two requests that shared their first k blocks have
the same first k hashes, and only then, so a replay can rebuild prompts with the same sharing
structure (sim/trace_replay.py: tokens drawn from each hash) without ever knowing the text.
`keep_prompts=True` writes the prompt and output token ids too (exact replay).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

FORMAT = "jupyter-pagedkv-trace"
VERSION = 1


@dataclass
class TraceRequest:
    """One recorded request. Steps are engine step indices counted from the start of the recording."""

    request_id: str
    arrival_s: float
    arrival_step: int
    prompt_len: int
    block_hashes: list[str]
    prompt_hash: str
    sampling: dict[str, Any]                 # SamplingParams fields that differ from the defaults
    max_tokens: int                          # the cap after intake (what contiguous reserves)
    tenant: str | None = None
    priority: int = 0
    output_len: int | None = None            # None: still live when the recording stopped
    finish_reason: str | None = None
    admitted_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    prompt_token_ids: list[int] | None = None     # keep_prompts only
    output_token_ids: list[int] | None = None     # keep_prompts only

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None},
                          separators=(",", ":"))


@dataclass
class TraceHeader:
    model: str
    revision: str | None
    block_size: int
    vocab_size: int
    keeps_prompts: bool
    config: dict[str, Any] = field(default_factory=dict)
    tenants: dict[str, dict] = field(default_factory=dict)   # name -> {"weight", "max_blocks"}
    skipped: int = 0                                         # beam searches (not replayable)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)},
                          separators=(",", ":"), default=str)


@dataclass
class Trace:
    header: TraceHeader
    requests: list[TraceRequest]

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [self.header.to_json()] + [r.to_json() for r in self.requests]
        path.write_text("\n".join(lines) + "\n")
        return path

    @property
    def finished(self) -> list[TraceRequest]:
        """The requests a replay can reproduce: those that finished, with a token, while recording."""
        return [r for r in self.requests if r.output_len]


def read_trace(path: str | Path) -> Trace:
    """Read a trace file; a missing, foreign or newer file is one ValueError line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no trace at {str(path)!r}: record one with `%pagedkv record start NAME` "
                         "(or engine.record(path)) first")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    try:
        head = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        head = {}
    if head.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a jupyter-pagedkv trace (its first line has no "
                         f"'format': {FORMAT!r})")
    if head.get("version") != VERSION:
        raise ValueError(f"{str(path)!r} is trace format version {head.get('version')!r}; this "
                         f"jupyter-pagedkv reads version {VERSION}: upgrade it or record again")
    names = {f.name for f in dataclasses.fields(TraceHeader)}
    header = TraceHeader(**{k: v for k, v in head.items() if k in names})
    fields = {f.name for f in dataclasses.fields(TraceRequest)}
    try:
        requests = [TraceRequest(**{k: v for k, v in json.loads(ln).items() if k in fields}) for ln in lines[1:]]
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"{str(path)!r} has a malformed request line ({err}): record it again") from None
    return Trace(header, requests)


class BlockHasher:
    """Chained, keyed block hashes: equal hashes mean equal prefixes (the engine's own chain,
    core/block_pool.py's `hash_block`), but stable across processes and, with a key that is not
    written, saying nothing of the tokens. 16 hex digits (64 bits) per block."""

    def __init__(self, block_size: int, key: bytes | None = None) -> None:
        self.block_size = block_size
        self.key = key if key is not None else os.urandom(16)

    def _hash(self, parent: str, tokens: Sequence[int]) -> str:
        h = hashlib.blake2b(digest_size=8, key=self.key)
        h.update(parent.encode())
        h.update(b"|" + ",".join(map(str, tokens)).encode())
        return h.hexdigest()

    def block_hashes(self, token_ids: Sequence[int]) -> list[str]:
        bs, out, parent = self.block_size, [], ""
        for i in range(len(token_ids) // bs):
            parent = self._hash(parent, token_ids[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def prompt_hash(self, token_ids: Sequence[int], block_hashes: Iterable[str]) -> str:
        """The whole prompt: its last full block's hash chained with the partial tail."""
        last = list(block_hashes)[-1:] or [""]
        return self._hash("p" + last[0], token_ids[len(token_ids) // self.block_size * self.block_size:])
