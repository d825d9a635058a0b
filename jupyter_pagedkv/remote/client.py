"""A client for an OpenAI-compatible server (vLLM) with the local engine's interface.

`Engine.connect(url)` returns a `RemoteEngine`, an `EngineClient` like the local engine: the
same `generate` / `chat` / `stream` (shared code, `GenerationFront`), `add_request(listener=...)` /
`abort`, `stats`, `observe`, `request_rows`, so `%%generate`, `%%chat`, the monitor and the
JupyterLab panel work with a server exactly as with the kernel's engine.
Each request is one HTTP connection (stdlib `http.client`) read as server-sent events on its own
daemon thread; aborting shuts the socket down, which is also what the server takes as "cancel".

Errors are one line each (`RemoteError`): unreachable, timed out, auth refused, unknown model,
and a stream that ends without its finish reason ("dropped") — the request then finishes as
"error" with the error attached, so a cell never waits on a dead connection.
"""
from __future__ import annotations

import http.client
import itertools
import json
import logging
import queue
import socket
import threading
import time
from collections import deque
from typing import Callable
from urllib.parse import urlsplit

from ..core.sampling_params import SamplingParams
from ..core.stats import Throughput
from ..engine.frontend import GenerationFront, check_messages
from ..engine.intake import check_params, check_request_fields, check_tenant
from ..engine.outputs import RequestMetrics, RequestOutput, StreamDelta
from . import api_key as api_key_source, wire
from .cache_salt import check_salt_support, salt_refused
from .errors import RemoteError
from .inspection import RemoteInspection
from .remote_request import RemoteRequest, fold_chunk, request_output
from .request_fields import ChatPrompt, request_body


logger = logging.getLogger(__name__)


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


class RemoteEngine(RemoteInspection, GenerationFront):
    """An `EngineClient` over a vLLM (OpenAI-compatible) server."""

    is_running = True          # the server runs its own loop; nothing to start here
    has_chat_template = True   # the server applies the model's own template

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 60.0, kv_events: str | None = None, kv_events_topic: str = "",
                 api_key_env: str | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.scheme, self.host, self.port, self.prefix = _base_url(url)
        self.url = f"{self.scheme}://{self.host}:{self.port}{self.prefix}"
        self.api_key = api_key_source.for_server(api_key, api_key_env, self.scheme, self.host)   # api_key.py
        self.timeout = timeout
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._shutdown_listeners: list[Callable[[], None]] = []
        self._requests: dict[str, RemoteRequest] = {}
        self.finished_requests: deque[RemoteRequest] = deque(maxlen=1000)
        self._throughput = Throughput()      # the same window and rule as the local engine's
        self._last_generated: float | None = None
        self._num_polls = 0
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
        if self.api_key is not None:
            h["Authorization"] = self.api_key.header()
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
            hint = f"check {self.api_key}" if self.api_key else "set VLLM_API_KEY to the server's key"
            return RemoteError(f"{self.url} refused the request (HTTP {status}, unauthorized): {hint}")
        if status == 400 and "cache_salt" in message:
            return salt_refused(self.url, getattr(self, "version", None), message)
        if status == 404 and "model" in message.lower():
            return RemoteError(f"{self.url}: {message}; pass --model with one of "
                               f"{', '.join(getattr(self, 'served_models', []) or ['its models'])}")
        return RemoteError(f"{self.url} answered HTTP {status}: {message or 'no details'}")

    def _get(self, path: str, what: str) -> tuple[int, bytes]:
        conn = self._connection()
        try:
            conn.request("GET", self.prefix + path, headers=self._headers())
            resp = conn.getresponse()
            return resp.status, wire.read_body(resp, self.url)
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
            if not all(isinstance(m, str) for m in models):
                raise TypeError("model ids are not strings")
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"{self.url}/v1/models is not an OpenAI-compatible model list: "
                              f"check the URL") from None
        if not models:
            raise RemoteError(f"{self.url} serves no model")
        return models

    def _version(self) -> str | None:
        try:
            status, body = self._get("/version", "its version")
            version = json.loads(body).get("version") if status == 200 else None
            return version if isinstance(version, str) else None
        except (RemoteError, ValueError, AttributeError):
            return None

    # -- requests -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> ChatPrompt:
        """The conversation itself: the server templates it (with the model's own template)."""
        check_messages(messages)
        return ChatPrompt(tuple(dict(m) for m in messages))

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, listener: queue.SimpleQueue | None = None,
                    tenant: str | None = None) -> str:
        """Start one streamed request on its own thread; returns its id (as the local engine's).
        `tenant` goes as vLLM's cache_salt (>= 0.9; else one line, nothing sent): the server salts
        per request, so a named tenant's prefixes are always isolated (no "global" scope here).
        A non-zero `priority` goes as vLLM's `priority` field (the server needs its priority policy)."""
        check_request_fields(request_id, priority)
        if (tenant := check_tenant(tenant)) is not None:
            check_salt_support(self.url, self.version)
        params = check_params(params)
        if not isinstance(params, SamplingParams) or params.n > wire.MAX_CHOICES:
            raise ValueError(f"a server request takes SamplingParams with n <= {wire.MAX_CHOICES}")
        body = request_body(prompt, params, self.model, self.version is not None)
        if tenant is not None:
            body["cache_salt"] = tenant
        if priority:
            body["priority"] = priority
        text = prompt if isinstance(prompt, str) else None
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
        with self._lock:
            rid = request_id if request_id is not None else f"remote-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            req = RemoteRequest(rid, text, ids, params, RequestMetrics(time.perf_counter()), tenant=tenant)
            if listener is not None:
                req.listeners.append(listener)
            self._requests[rid] = req
        chat = isinstance(prompt, ChatPrompt)
        req.thread = threading.Thread(target=self._run, args=(req, body, chat), daemon=True,
                                      name=f"pagedkv-remote-{rid}")
        req.thread.start()
        return rid


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
                req.error = self._http_error(resp.status, wire.read_body(resp, self.url))
                return
            self._read_events(req, resp, chat)
        except RemoteError as err:   # what the server sent broke a rule of wire.py: one line
            if not req.aborted:
                req.error = err
        except (OSError, http.client.HTTPException, ValueError) as err:
            if not req.aborted:
                req.error = (self._network_error(err, "while streaming")
                             if isinstance(err, (socket.timeout, TimeoutError))
                             else RemoteError(f"the stream from {self.url} dropped "
                                              f"({err.__class__.__name__}: {err}); the output so far "
                                              f"is kept, run the cell again for the rest"))
        except BaseException as err:   # never leave a cell waiting on this request
            logger.warning("request %s: reading the stream failed", req.request_id, exc_info=True)
            req.error = err
        finally:
            self._finish(req)

    def _read_events(self, req: RemoteRequest, resp: http.client.HTTPResponse, chat: bool) -> None:
        """Fold the server-sent events into the request, each checked (wire.py); [DONE] or finish
        reasons end it."""
        stream = wire.EventStream(resp, self.url, self.timeout)
        for data in stream.events():
            chunk = wire.parse_chunk(data, req.params.n, chat, self.url)
            if chunk.error is not None:
                raise RemoteError(f"{self.url} failed the request: {chunk.error}")
            fold_chunk(req, chunk)
        if not stream.done and not req.aborted:
            missing = [i for i in range(req.params.n) if i not in req.finish]
            if missing:
                raise RemoteError(f"the stream from {self.url} dropped before the end (no finish "
                                  f"reason after {req.num_output_tokens} tokens); the "
                                  f"output so far is kept, run the cell again for the rest")

    def _finish(self, req: RemoteRequest) -> None:
        with self._lock:
            if req.done.is_set():
                return
            req.metrics.finish_time = time.perf_counter()
            if not req.metrics.num_generated_tokens:
                req.metrics.num_generated_tokens = len(req.tokens.get(0, []))
            if req.aborted or req.error is not None:
                # Cancelled by the caller: "abort"; failed (network, server): "error".
                reason = "abort" if req.aborted else "error"
                for i in range(req.params.n):
                    if req.finish.get(i) is None:
                        req.finish[i] = reason
            self._requests.pop(req.request_id, None)
            self.finished_requests.append(req)
            req.done.set()
        out = request_output(req)
        error = None if req.aborted else req.error
        for q in req.listeners:
            q.put(StreamDelta(req.request_id, "", [], True, out.finish_reason, out, error))
        if req.conn is not None:
            req.conn.close()


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

    # -- what GenerationFront (generate / chat / stream) needs ------------------------------------------
    def step(self) -> list:
        return []          # never called: the server steps itself (is_running)

    def _handle(self, rid: str) -> RemoteRequest:
        with self._lock:
            req = self._requests.get(rid)
        return req or next(r for r in reversed(self.finished_requests) if r.request_id == rid)

    def _result(self, req: RemoteRequest) -> RequestOutput:
        return request_output(req)

    def chat_prompt(self, messages: list[dict], previous: list[int] | None = None) -> tuple[ChatPrompt, bool]:
        """The conversation itself (the server templates it and finds the cached prefix)."""
        return self.apply_chat_template(messages), False

    def add_drafter(self, speculative) -> str:
        raise ValueError("speculative decoding of a server is configured where it runs "
                         "(e.g. `vllm serve --speculative-config ...`), not per request from here")

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        """Abort what is still streaming and stop the event listener (the server keeps running)."""
        for req in self.live_requests():
            self.abort(req.request_id)
        if self.events is not None:
            self.events.close()
        for listener in self._shutdown_listeners:
            listener()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.name!r})"
