"""A client for an OpenAI-compatible server (vLLM) with the local engine's surface.

`Engine.connect(url)` returns a `RemoteEngine`: `generate` / `chat` / `stream` / `stats` /
`pool_snapshot` and the `add_request(listener=...)` / `abort` pair that the magics' `CellRun`
drives, so `%%generate` and `%%chat` stream from the server exactly as from the kernel's engine.
Each request is one HTTP connection (stdlib `http.client`) read as server-sent events on its own
daemon thread; aborting shuts the socket down, which is also what the server takes as "cancel".

Errors are one line each (`RemoteError`): unreachable, timed out, auth refused, unknown model,
and a stream that ends without its finish reason ("dropped") — the request then finishes as
"abort" with the error attached, so a cell never waits on a dead connection.
"""
from __future__ import annotations

import http.client
import itertools
import json
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Sequence as Seq
from urllib.parse import urlsplit

from ..engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from ..core.sampling_params import SamplingParams
from .server_metrics import (FINISHED, GENERATED, KV_USAGE, PREEMPTIONS, PREFIX_HITS,
                             PREFIX_QUERIES, RUNNING, WAITING, RemoteStats, ServerMetrics,
                             parse_prometheus)


class RemoteError(RuntimeError):
    """A server-side or network failure, worded as one line that says what to do."""


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation for the server to template (its own chat template, not a local tokenizer)."""

    messages: tuple[dict, ...]


class ServerTemplate:
    """Stands in for a tokenizer in the magics' checks: the server applies the chat template."""

    chat_template = "(applied by the server)"


@dataclass(frozen=True)
class RemoteDevice:
    """What the monitor channel shows as the device: the server, not this machine."""

    type: str = "remote"


class RemoteStatus(Enum):
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class _NoBlocks:
    blocks: tuple = ()


@dataclass
class RemoteSeq:
    """The per-sample view `%pagedkv requests` reads (the server keeps the real one)."""

    num_output_tokens: int = 0
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    status: RemoteStatus = RemoteStatus.RUNNING
    block_table: _NoBlocks = field(default_factory=_NoBlocks)

    @property
    def is_finished(self) -> bool:
        return self.status is RemoteStatus.FINISHED


@dataclass(eq=False)
class RemoteRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    listeners: list[queue.SimpleQueue] = field(default_factory=list)
    seqs: list[RemoteSeq] = field(default_factory=lambda: [RemoteSeq()])
    texts: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    aborted: bool = False
    conn: http.client.HTTPConnection | None = None
    sock: socket.socket | None = None    # kept: http.client drops conn.sock once a response owns it
    thread: threading.Thread | None = None

    @property
    def finished(self) -> bool:
        return self.done.is_set()


def _base_url(url: str) -> tuple[str, str, int, str]:
    """'host:8000', 'http://h:8000/v1' ... -> (scheme, host, port, path prefix without /v1)."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a server URL: {url!r}; give e.g. http://127.0.0.1:8000")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), path


class RemoteEngine:
    """The kernel's engine surface over a vLLM (OpenAI-compatible) server."""

    is_remote = True
    is_running = True          # the server runs its own loop; nothing to start here
    device = RemoteDevice()
    dtype = "server"           # the server's own dtype; /metrics does not say which

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 60.0, kv_events: str | None = None, kv_events_topic: str = "") -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.scheme, self.host, self.port, self.prefix = _base_url(url)
        self.url = f"{self.scheme}://{self.host}:{self.port}{self.prefix}"
        self.api_key = api_key
        self.timeout = timeout
        self.tokenizer = ServerTemplate()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._feed_lock = threading.Lock()
        self._monitor_feed = None
        self._requests: dict[str, RemoteRequest] = {}
        self.finished_requests: deque[RemoteRequest] = deque(maxlen=1000)
        self._rate: deque[tuple[float, float]] = deque(maxlen=64)   # (time, generation_tokens_total)
        served = self._served_models()
        if model is None:
            model = served[0]
        elif model not in served:
            raise RemoteError(f"model {model!r} is not served by {self.url}: it serves "
                              f"{', '.join(served)}; pass --model {served[0]}")
        self.model = model
        self.served_models = served
        self.version = self._version()
        self.name = f"{model} @ {self.url}"
        self.events = None
        if kv_events:
            from .kv_events import KVEventListener
            self.events = KVEventListener(kv_events, kv_events_topic)

    # -- HTTP ---------------------------------------------------------------------------------------
    def _connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout or self.timeout)

    def _headers(self, body: bool = False) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream"}
        if body:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _network_error(self, err: BaseException, what: str) -> RemoteError:
        if isinstance(err, (socket.timeout, TimeoutError)):
            return RemoteError(f"{self.url} did not answer {what} within {self.timeout:g} s: the server "
                               f"is busy or stuck; raise the timeout (--timeout) or check its log")
        if isinstance(err, socket.gaierror):
            return RemoteError(f"cannot resolve {self.host}: check the server URL")
        if isinstance(err, ConnectionRefusedError):
            return RemoteError(f"cannot reach {self.url}: connection refused; is the server running "
                               f"(e.g. `vllm serve MODEL --port {self.port}`)?")
        return RemoteError(f"cannot reach {self.url}: {err.__class__.__name__}: {err}")

    def _http_error(self, status: int, body: bytes) -> RemoteError:
        try:
            detail = json.loads(body)
            detail = detail.get("error", detail) if isinstance(detail, dict) else detail
            message = detail.get("message", str(detail)) if isinstance(detail, dict) else str(detail)
        except (ValueError, AttributeError):
            message = body.decode("utf-8", "replace").strip()[:200]
        message = " ".join(str(message).split())
        if status in (401, 403):
            hint = "pass the server's key with --api-key" if not self.api_key else "check --api-key"
            return RemoteError(f"{self.url} refused the request (HTTP {status}, unauthorized): {hint}")
        if status == 404 and "model" in message.lower():
            return RemoteError(f"{self.url}: {message}; pass --model with one of "
                               f"{', '.join(getattr(self, 'served_models', []) or ['its models'])}")
        return RemoteError(f"{self.url} answered HTTP {status}: {message or 'no details'}")

    def _get(self, path: str, what: str) -> tuple[int, bytes]:
        conn = self._connection()
        try:
            conn.request("GET", self.prefix + path, headers=self._headers())
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as err:
            raise self._network_error(err, what) from None
        finally:
            conn.close()

    def _served_models(self) -> list[str]:
        status, body = self._get("/v1/models", "the model list")
        if status != 200:
            raise self._http_error(status, body)
        try:
            models = [m["id"] for m in json.loads(body)["data"]]
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"{self.url}/v1/models is not an OpenAI-compatible model list: "
                              f"check the URL") from None
        if not models:
            raise RemoteError(f"{self.url} serves no model")
        return models

    def _version(self) -> str | None:
        try:
            status, body = self._get("/version", "its version")
            return json.loads(body).get("version") if status == 200 else None
        except (RemoteError, ValueError, AttributeError):
            return None

    # -- requests -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> ChatPrompt:
        """The conversation itself: the server templates it (with the model's own template)."""
        return ChatPrompt(tuple(dict(m) for m in messages))

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, listener: queue.SimpleQueue | None = None) -> str:
        """Start one streamed request on its own thread; returns its id (as the local engine's)."""
        params = params or SamplingParams()
        params.validate()
        body = self._body(prompt, params)
        text = prompt if isinstance(prompt, str) else None
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
        with self._lock:
            rid = request_id if request_id is not None else f"remote-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            req = RemoteRequest(rid, text, ids, params, RequestMetrics(time.perf_counter()))
            if listener is not None:
                req.listeners.append(listener)
            self._requests[rid] = req
        chat = isinstance(prompt, ChatPrompt)
        req.thread = threading.Thread(target=self._run, args=(req, body, chat), daemon=True,
                                      name=f"pagedkv-remote-{rid}")
        req.thread.start()
        return rid

    def _body(self, prompt, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "top_p": params.top_p,
                                "n": params.n, "stream": True,
                                "stream_options": {"include_usage": True}}
        if isinstance(prompt, ChatPrompt):
            body["messages"] = list(prompt.messages)
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("empty prompt: give some text or token ids")
            body["prompt"] = prompt
        else:
            ids = list(prompt)
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError("prompt token ids must be a non-empty list of non-negative integers")
            body["prompt"] = ids
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        # vLLM's extensions of the OpenAI request; other servers would reject unknown fields.
        if self.version is not None:
            body["return_token_ids"] = True
            if params.top_k > 0:
                body["top_k"] = params.top_k
            if params.ignore_eos:
                body["ignore_eos"] = True
            if params.stop_token_ids:
                body["stop_token_ids"] = list(params.stop_token_ids)
        elif params.top_k > 0 or params.ignore_eos or params.stop_token_ids:
            raise ValueError("top_k, ignore_eos and stop_token_ids need a vLLM server")
        return body

    def _run(self, req: RemoteRequest, body: dict, chat: bool) -> None:
        path = self.prefix + ("/v1/chat/completions" if chat else "/v1/completions")
        try:
            conn = req.conn = self._connection()
            if req.aborted:
                return
            try:
                conn.connect()
                req.sock = conn.sock
                if req.aborted:
                    return
                conn.request("POST", path, body=json.dumps(body).encode(), headers=self._headers(True))
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as err:
                if not req.aborted:
                    req.error = self._network_error(err, "the request")
                return
            if resp.status != 200:
                req.error = self._http_error(resp.status, resp.read())
                return
            self._read_events(req, resp, chat)
        except (OSError, http.client.HTTPException, ValueError) as err:
            if not req.aborted:
                req.error = (self._network_error(err, "while streaming")
                             if isinstance(err, (socket.timeout, TimeoutError))
                             else RemoteError(f"the stream from {self.url} dropped "
                                              f"({err.__class__.__name__}: {err}); the output so far "
                                              f"is kept, run the cell again for the rest"))
        except BaseException as err:   # never leave a cell waiting on this request
            req.error = err
        finally:
            self._finish(req)

    def _read_events(self, req: RemoteRequest, resp: http.client.HTTPResponse, chat: bool) -> None:
        """Fold the server-sent events into the request; [DONE] or finish reasons end it."""
        done = False
        while True:
            raw = resp.readline()
            if not raw:
                break
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk and "choices" not in chunk:
                err = chunk["error"]
                raise RemoteError(f"{self.url} failed the request: "
                                  f"{err.get('message', err) if isinstance(err, dict) else err}")
            self._fold_chunk(req, chunk, chat)
        if not done and not req.aborted:
            missing = [i for i in range(req.params.n) if i not in req.finish]
            if missing:
                raise RemoteError(f"the stream from {self.url} dropped before the end (no finish "
                                  f"reason after {req.seqs[0].num_output_tokens} tokens); the "
                                  f"output so far is kept, run the cell again for the rest")

    def _fold_chunk(self, req: RemoteRequest, chunk: dict, chat: bool) -> None:
        now = time.perf_counter()
        if chunk.get("prompt_token_ids") and not req.prompt_token_ids:
            req.prompt_token_ids = list(chunk["prompt_token_ids"])
        new_text, new_tokens = "", []
        for choice in chunk.get("choices") or []:
            i = int(choice.get("index", 0))
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            piece = piece or ""
            toks = list(choice.get("token_ids") or [])
            if choice.get("prompt_token_ids") and not req.prompt_token_ids:
                req.prompt_token_ids = list(choice["prompt_token_ids"])
            req.texts[i] = req.texts.get(i, "") + piece
            req.tokens.setdefault(i, []).extend(toks)
            if choice.get("finish_reason"):
                req.finish[i] = choice["finish_reason"]
            if i == 0:
                new_text += piece
                new_tokens += toks
        usage = chunk.get("usage")
        if usage:
            req.metrics.num_generated_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            req.seqs[0].num_cached_tokens = int(details.get("cached_tokens") or 0)
        if (new_text or new_tokens) and req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.seqs[0].num_output_tokens = len(req.tokens.get(0, [])) or req.seqs[0].num_output_tokens
        if new_text or new_tokens:
            delta = StreamDelta(req.request_id, new_text, new_tokens, False)
            for q in req.listeners:
                q.put(delta)

    def _finish(self, req: RemoteRequest) -> None:
        with self._lock:
            if req.done.is_set():
                return
            req.metrics.finish_time = time.perf_counter()
            if not req.metrics.num_generated_tokens:
                req.metrics.num_generated_tokens = len(req.tokens.get(0, []))
            seq = req.seqs[0]
            seq.status = RemoteStatus.FINISHED
            if req.aborted or req.error is not None:
                for i in range(req.params.n):
                    req.finish.setdefault(i, "abort")
                    if req.finish[i] is None:
                        req.finish[i] = "abort"
            seq.finish_reason = req.finish.get(0, "abort")
            self._requests.pop(req.request_id, None)
            self.finished_requests.append(req)
            req.done.set()
        out = self._output(req)
        for q in req.listeners:
            q.put(StreamDelta(req.request_id, "", [], True, out.finish_reason, out))
        if req.conn is not None:
            req.conn.close()

    def _output(self, req: RemoteRequest) -> RequestOutput:
        n = max([req.params.n] + [i + 1 for i in req.texts])
        outs = [CompletionOutput(i, req.texts.get(i, ""), req.tokens.get(i, []), req.finish.get(i))
                for i in range(n)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             req.seqs[0].num_cached_tokens or 0, req.metrics)

    def abort(self, request_id: str) -> bool:
        """Cancel a request: shut its connection (vLLM aborts on disconnect); False if not live."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.done.is_set():
                return False
            req.aborted = True
            sock = req.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not req.done.wait(5.0):
            self._finish(req)
        return True

    def live_requests(self) -> list[RemoteRequest]:
        with self._lock:
            return list(self._requests.values())

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests)

    # -- high-level API (the local engine's) ------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Send every prompt at once (the server batches them); outputs in order. Errors raise."""
        prompt_list = [prompts] if isinstance(prompts, (str, ChatPrompt)) or (
            prompts and isinstance(prompts, list) and isinstance(prompts[0], int)) else list(prompts)
        param_list = (list(params) if isinstance(params, (list, tuple))
                      else [params or SamplingParams()] * len(prompt_list))
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompt_list, param_list):
                ids.append(self.add_request(p, sp))
            reqs = [self._get_request(rid) for rid in ids]
            for req in reqs:
                req.done.wait()
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        for req in reqs:
            if req.error is not None:
                raise req.error
        return [self._output(r) for r in reqs]

    def chat(self, messages, params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (list of {role, content}) or a list of them, templated by the server."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in conversations], params)

    def stream(self, prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield text increments; closing the iterator aborts the request on the server."""
        listener: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.add_request(prompt, params, request_id, listener=listener)
        req = self._get_request(rid)
        try:
            while True:
                delta = listener.get()
                yield delta
                if delta.finished:
                    if req.error is not None:
                        raise req.error
                    return
        finally:
            if not req.done.is_set():
                self.abort(rid)

    def _get_request(self, rid: str) -> RemoteRequest:
        with self._lock:
            req = self._requests.get(rid)
        return req or next(r for r in self.finished_requests if r.request_id == rid)

    # -- introspection -----------------------------------------------------------------------------------
    def metrics(self) -> ServerMetrics:
        """One scrape of the server's Prometheus /metrics, filtered to the served model."""
        status, body = self._get("/metrics", "/metrics")
        if status != 200:
            raise self._http_error(status, body)
        return ServerMetrics(parse_prometheus(body.decode("utf-8", "replace")), self.model)

    def stats(self) -> RemoteStats:
        """The server's gauges as EngineStats (plus the block count its KV events imply)."""
        m = self.metrics()
        info = m.cache_info()
        num_blocks = int(float(info.get("num_gpu_blocks") or 0))
        block_size = int(float(info.get("block_size") or 0))
        usage = m.value(KV_USAGE)
        num_used = round(usage * num_blocks)
        generated = m.value(GENERATED)
        now = time.perf_counter()
        tps = 0.0
        with self._lock:
            self._rate.append((now, generated))
            window = [(t, g) for t, g in self._rate if now - t <= 10.0]
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            tps = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
        event_blocks = None
        notes = []
        if self.events is not None:
            snap = self.events.snapshot()
            event_blocks = snap.num_blocks
            if self.events.error:
                notes.append(self.events.error)
        else:
            notes.append("KV events: off (connect with --kv-events tcp://HOST:PORT for the block map)")
        if not m.has(KV_USAGE):
            notes.append("this server's /metrics has no KV-cache usage gauge")
        num_cached = max(0, event_blocks - num_used) if event_blocks is not None else 0
        return RemoteStats(
            num_blocks=num_blocks, block_size=block_size,
            num_free=max(0, num_blocks - num_used - num_cached), num_used=num_used,
            num_cached=num_cached, num_shared=0, kv_cache_usage=usage,
            tokens_stored=0, slots_allocated=num_used * block_size, internal_waste=0,
            prefix_cache_queries=int(m.value(PREFIX_QUERIES)), prefix_cache_hits=int(m.value(PREFIX_HITS)),
            num_running=int(m.value(RUNNING)), num_waiting=int(m.value(WAITING)), num_preempted=0,
            num_preemptions=int(m.value(PREEMPTIONS)), num_swapped_blocks=0,
            tokens_per_s=tps, num_generated_tokens=int(generated), num_finished=int(m.value(FINISHED)),
            latency_percentiles=self._percentiles(),
            source=f"{self.name}" + (f" (vLLM {self.version})" if self.version else ""),
            kv_event_blocks=event_blocks, notes=notes)

    def _percentiles(self) -> dict[str, dict[str, float]]:
        result = {}
        for name in ("ttft", "tpot", "latency"):
            values = sorted(v for r in list(self.finished_requests) if r.error is None
                            for v in [getattr(r.metrics, name)] if v is not None)
            if values:
                pick = lambda q: values[min(len(values) - 1, int(round(q * (len(values) - 1))))]
                result[name] = {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}
        return result

    def pool_snapshot(self, stats: RemoteStats | None = None) -> dict:
        """The local engine's snapshot shape, from the server's KV events and usage gauge (`stats`:
        a scrape already made, so a monitor polls /metrics once, not twice).

        Block positions are ours (events carry hashes, not physical ids): full blocks published by
        the server come first as 'cached' (reusable prefix), then the blocks /metrics says are in
        use beyond those (partly filled, never published) as 'used'; ref counts are not published.
        """
        stats = stats or self.stats()
        stored = stats.kv_event_blocks or 0
        n = max(stats.num_blocks, stored)
        states = ["free"] * n
        if self.events is not None:
            snap = self.events.snapshot()
            for slot in snap.slots.values():
                if slot < n:
                    states[slot] = "cached"
        extra = max(0, stats.num_used - stored)
        for i in range(n):
            if extra == 0:
                break
            if states[i] == "free":
                states[i] = "used"
                extra -= 1
        return {"num_blocks": n, "block_size": stats.block_size, "states": states,
                "ref_counts": [1 if s == "used" else 0 for s in states], "owners": {},
                "source": "kv-events" if self.events is not None else "metrics"}

    def check_invariants(self) -> None:
        """The server owns the blocks; here only: no request left live without its thread."""
        with self._lock:
            for req in self._requests.values():
                assert req.thread is not None and req.thread.is_alive(), \
                    f"{req.request_id} is live without a reader thread"

    def reset_prefix_cache(self) -> int:
        """Ask the server to drop its prefix cache (vLLM: only with VLLM_SERVER_DEV_MODE=1).

        Returns the full blocks the KV events knew of (0 without events: the server does not say)."""
        known = self.events.snapshot().num_blocks if self.events is not None else 0
        conn = self._connection()
        try:
            conn.request("POST", self.prefix + "/reset_prefix_cache", headers=self._headers())
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as err:
            raise self._network_error(err, "reset_prefix_cache") from None
        finally:
            conn.close()
        if resp.status == 404:
            raise RemoteError(f"{self.url} has no /reset_prefix_cache: start vLLM with "
                              f"VLLM_SERVER_DEV_MODE=1 to allow it")
        if resp.status != 200:
            raise self._http_error(resp.status, body)
        return known

    def summary_line(self) -> str:
        s = self.stats()
        return (f"{self.name}" + (f" (vLLM {self.version})" if self.version else "") +
                f": {s.num_blocks:,} blocks × {s.block_size} = {s.num_blocks * s.block_size:,} tokens "
                f"of KV on the server" + (", KV events on" if self.events is not None else ""))

    @property
    def monitor_feed(self):
        """The one RemoteMonitorFeed of this client (created on first use), shared by every monitor."""
        with self._feed_lock:         # not self._lock: creating the feed calls stats(), which takes it
            if self._monitor_feed is None:
                from .monitor import RemoteMonitorFeed
                self._monitor_feed = RemoteMonitorFeed(self)
            return self._monitor_feed

    def monitor(self, **kwargs):
        """The live block-pool widget, drawn from the server's /metrics and KV events."""
        from ..widgets import BlockPoolMonitor
        return BlockPoolMonitor(self, **kwargs)

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        """Abort what is still streaming and stop the event listener (the server keeps running)."""
        for req in self.live_requests():
            self.abort(req.request_id)
        if self.events is not None:
            self.events.close()
        if self._monitor_feed is not None:
            self._monitor_feed.close()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.name!r})"
