"""Markdown answers in a real browser: a `%%generate` streams a Markdown answer (a list, a bold
phrase, a table, a fenced code block) into JupyterLab, which must show them as HTML elements, not
as literal asterisks and backticks, both while the answer is still arriving (paused half-way
through the code block, its fence still open) and after it ends.

The answer comes from a scripted OpenAI-compatible server in this process, reached with
`%pagedkv connect`: the kernel, the server client, the streaming and the Markdown renderer are the
product's own; only the model's words are fixed, so the test knows what must render. The server
holds the stream mid-code-block until the test has looked. Screenshots go to
test-artifacts/browser/markdown-*.png.

Needs what test_browser_monitor.py needs (Chromium, playwright, jupyterlab); its JupyterLab server
fixture (browser_lab.py) is reused, with this notebook put there through the contents API.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from browser_lab import ARTIFACTS, lab, lab_page, run_cell, settle, wait_done  # noqa: F401

# JupyterLab and Chromium start in the module's first test (its fixtures' setup counts).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(1200)]

HEAD = """Paging in three steps:

- Split the cache into **fixed-size blocks**.
- Keep a *block table* per sequence.

| state | owners |
|-------|--------|
| used  | one    |
| shared | two or more |

```python
def free(block):
"""
TAIL = """    pool.release(block)
```

Done."""
OUTPUT = ".jp-Notebook .jp-Cell:nth-child(3) .jp-OutputArea-output"


class ScriptedServer(BaseHTTPRequestHandler):
    """Model 'm': streams HEAD a few characters at a time, waits for `release`, then TAIL."""

    paused = threading.Event()
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def _json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": "m"}]})
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        chat = self.path.endswith("/chat/completions")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(piece: str, finish: str | None = None) -> None:
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()

        for i in range(0, len(HEAD), 4):
            send(HEAD[i:i + 4])
            time.sleep(0.02)
        type(self).paused.set()
        type(self).release.wait(timeout=300)
        for i in range(0, len(TAIL), 4):
            send(TAIL[i:i + 4])
            time.sleep(0.02)
        send("", "stop")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture(scope="module")
def server():
    handler = type("Handler", (ScriptedServer,), {"paused": threading.Event(), "release": threading.Event()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    handler.release.set()
    httpd.shutdown()
    httpd.server_close()


def put_notebook(lab: str, name: str, nb) -> None:
    """Save `nb` on the server through its contents API. Jupyter refuses a write without its XSRF
    token, which it hands out as the `_xsrf` cookie of any page: fetch one, then send it back."""
    import http.cookiejar

    import nbformat

    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(f"{lab}/lab", timeout=30).read()
    xsrf = next((c.value for c in jar if c.name == "_xsrf"), "")
    put = urllib.request.Request(f"{lab}/api/contents/{name}", method="PUT",
                                 data=json.dumps({"type": "notebook",
                                                  "content": json.loads(nbformat.writes(nb))}).encode(),
                                 headers={"Content-Type": "application/json", "X-XSRFToken": xsrf})
    opener.open(put, timeout=30).read()


@pytest.fixture(scope="module")
def page(lab, server):
    import nbformat

    _, url = server
    cells = ["%load_ext jupyter_pagedkv", f"%pagedkv connect {url} --model m --timeout 600",
             "%%generate --max-tokens 200\nExplain paging."]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    put_notebook(lab, "markdown.ipynb", nb)
    with lab_page(lab, "markdown.ipynb", {"width": 1200, "height": 1000}) as pg:
        run_cell(pg, 0)
        run_cell(pg, 1, timeout=60)
        yield pg


READ = """(selector) => {
  const out = document.querySelector(selector);
  if (!out) return null;
  // The rendered Markdown is the output element itself (or, in some versions, inside it).
  const md = out.matches('.jp-RenderedMarkdown') || !!out.querySelector('.jp-RenderedMarkdown');
  return {
    markdown: !!md,
    text: out.innerText,
    items: [...out.querySelectorAll('li')].map(e => e.innerText),
    strong: [...out.querySelectorAll('strong')].map(e => e.innerText),
    em: [...out.querySelectorAll('em')].map(e => e.innerText),
    cells: [...out.querySelectorAll('table td')].map(e => e.innerText.trim()),
    code: [...out.querySelectorAll('pre code')].map(e => e.innerText),
    highlighted: out.querySelectorAll('pre code span[class]').length,
  };
}"""


def read(page) -> dict | None:
    return page.evaluate(READ, OUTPUT)


def assert_rendered(shown: dict) -> None:
    assert shown["markdown"], shown
    assert shown["items"] == ["Split the cache into fixed-size blocks.", "Keep a block table per sequence."], shown
    assert "fixed-size blocks" in shown["strong"] and "block table" in shown["em"], shown
    assert shown["cells"][:4] == ["used", "one", "shared", "two or more"], shown
    assert len(shown["code"]) == 1 and shown["code"][0].startswith("def free(block):"), shown
    for literal in ("**", "```", "| state", "- Split"):
        assert literal not in shown["text"], (literal, shown["text"])


def test_a_streaming_answer_renders_its_markdown_while_its_code_fence_is_still_open(page, server):
    handler, _ = server
    run_cell(page, 2, wait=False)
    assert handler.paused.wait(timeout=120), "the kernel never asked the scripted server"
    # The renderer shows the latest text within its 0.25 s interval even with nothing more
    # arriving; the front end then renders and highlights it asynchronously: poll until it has.
    deadline = time.monotonic() + 120
    shown = read(page)
    while time.monotonic() < deadline:
        try:
            assert_rendered(shown)
            break
        except AssertionError:
            time.sleep(0.2)
            shown = read(page)
    page.screenshot(path=str(ARTIFACTS / "markdown-streaming.png"))
    try:
        assert_rendered(shown)
        assert "tokens generated" not in shown["text"]     # still streaming: no footer yet
    finally:
        handler.release.set()


def test_the_finished_answer_keeps_its_markdown_and_ends_with_the_footer(page, server):
    wait_done(page, 2, timeout=120)
    # The prompt number comes with the execute reply; the last render (Markdown, highlighting, the
    # footer) is the front end's own async work and may land after it: poll until it has.
    shown = settle(lambda: read(page), lambda s: s["text"].rstrip().endswith("· stop]") and s["highlighted"] > 0)
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "markdown-finished.png"))
    assert_rendered(shown)
    assert shown["code"][0].strip() == "def free(block):\n    pool.release(block)"
    assert shown["highlighted"] > 0          # the front end's own highlighter styled the code
    assert shown["text"].rstrip().endswith("· stop]"), shown["text"][-200:]
    assert any("tokens generated" in e for e in shown["em"])
