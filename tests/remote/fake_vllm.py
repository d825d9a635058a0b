"""A tiny fake OpenAI-compatible (vLLM) HTTP server, in-process, for the server client's tests
(test_remote_units.py, test_remote_tenant.py): import `fake` (the fixture) and `METRICS`."""
from __future__ import annotations

import json
import select
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0
vllm:prefix_cache_hits_total{engine="0",model_name="other"} 1000.0
vllm:generation_tokens_total{engine="0",model_name="m"} 500.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 6.0
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1.0
"""


class FakeServer(BaseHTTPRequestHandler):
    """Serves model 'm'; the prompt text picks the behaviour: ok, drop, hang (until the client
    leaves), error.

    It records every request body (`bodies`) and models vLLM's `cache_salt`: a salted prompt hits
    2 of its 3 tokens only when the same salt sent it before (`salted`); an unsalted one always
    does (the server's warm common cache). `version` is what /version reports (None: no such
    endpoint, as a server that is not vLLM); `refuse_salt`, when set, is the 400 a salted request
    gets (vLLM 0.9 on its V0 engine)."""

    key: str | None = None
    metrics: str = METRICS     # a test may swap in other gauges between scrapes
    version: str | None = "fake"
    refuse_salt: str | None = None
    bodies: list[dict] = []    # fresh per server (the fixture): every POST body, in order
    salted: set = set()        # (salt, prompt) pairs the salted cache holds

    def log_message(self, *args) -> None:
        pass

    def _authorized(self) -> bool:
        if self.key and self.headers.get("Authorization") != f"Bearer {self.key}":
            self._json(401, {"error": "Unauthorized"})
            return False
        return True

    def _json(self, status: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            body = self.metrics.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self._authorized() and self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "m"}]})
        elif self.path == "/version":
            if self.version is None:
                self._json(404, {"detail": "Not Found"})
            else:
                self._json(200, {"version": self.version})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(req)
        if not self._authorized():
            return
        if req["model"] != "m":
            self._json(404, {"error": {"message": f"The model `{req['model']}` does not exist."}})
            return
        salt = req.get("cache_salt")
        if salt is not None and self.refuse_salt:
            self._json(400, {"object": "error", "message": self.refuse_salt, "type": "BadRequestError",
                             "param": None, "code": 400})
            return
        prompt = req.get("prompt")
        key = (salt, json.dumps(prompt if prompt is not None else req.get("messages")))
        cached = 2 if salt is None or key in self.salted else 0
        if salt is not None:
            self.salted.add(key)
        if prompt == "fail500":
            self._json(500, {"error": {"message": "CUDA error: an illegal memory access was encountered"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(obj) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def logprobs(token: int) -> dict:
            """vLLM's completions shape with return_tokens_as_token_ids; the chosen token ranks 2nd."""
            if req.get("logprobs") is None:
                return {}
            top = {f"token_id:{token}": -1.0, "token_id:9": -0.5}
            return {"logprobs": {"tokens": [f"token_id:{token}"], "token_logprobs": [-1.0],
                                 "top_logprobs": [dict(list(top.items())[:req["logprobs"]])], "text_offset": [0]}}

        first = {"index": 0, "text": "Hello", "token_ids": [1], **logprobs(1)}
        if req.get("prompt_logprobs") is not None:
            first["prompt_logprobs"] = [None, {"6": {"logprob": -2.0, "rank": 4, "decoded_token": " b"}},
                                        {"7": {"logprob": -0.25, "rank": 1, "decoded_token": " c"}}]
        send({"choices": [first], "prompt_token_ids": [5, 6, 7]})
        if prompt == "hang":    # nothing more until the client goes (a timeout, an abort): EOF wakes it
            select.select([self.connection], [], [], 600)
            return
        send({"choices": [{"index": 0, "text": " world", "token_ids": [2], **logprobs(2)}]})
        if prompt == "drop":
            return   # connection closes without a finish reason or [DONE]
        if prompt == "garbled":
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"\n\n')   # cut-off JSON
            self.wfile.flush()
            return
        if prompt == "error-event":
            send({"error": {"message": "engine dead: EngineCore encountered an issue"}})
            return
        send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        send({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                       "prompt_tokens_details": {"cached_tokens": cached}}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake():
    """A fresh fake server on a free port: (its handler class, to configure, and its URL)."""
    handler = type("Handler", (FakeServer,), {"key": None, "metrics": METRICS, "version": "fake",
                                              "refuse_salt": None, "bodies": [], "salted": set()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def magic_shell():
    """An IPython shell with the magics loaded and a fresh kernel session (restored afterwards),
    for tests that drive a server through %pagedkv connect and %%generate."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    from jupyter_pagedkv.notebook import session
    from jupyter_pagedkv.notebook.session import KernelSession

    ip = start_ipython() or get_ipython()   # None once another module started it
    ip.run_line_magic("load_ext", "jupyter_pagedkv")
    saved, session._current = session._current, KernelSession()
    try:
        yield ip
    finally:
        session._current = saved
