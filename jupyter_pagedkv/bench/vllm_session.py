"""One vLLM CPU process kept alive across a benchmark, so its runs can interleave with ours.

`bench throughput --shapes` used to run all of our engine's shapes, then start vLLM once for all
of its own: the two blocks ran ten minutes apart, and this host's drift over that time landed in
the ratio (the same code read 1.51x and 2.07x two hours apart: docs/benchmarks.md, sixth
measurement). With a session, vLLM starts once (its start-up costs a minute or more) and then
runs each request set when asked, right beside our run of the same set.

The peer is peer_vllm.py `--serve` in its own venv (it cannot import us); the protocol is in its
docstring. Its stderr goes to a temporary file, so a chatty peer cannot fill a pipe and stall.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .peer_vllm import RESULT

PEER = Path(__file__).with_name("peer_vllm.py")


class PeerFailed(RuntimeError):
    """The peer process exited or answered with an error; the message carries its stderr's tail."""


class VllmSession:
    """`with VllmSession(python, model_dir, dtype) as peer: peer.run(name, requests)`."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, script: Path = PEER,
                 extra: tuple[str, ...] = ()) -> None:
        self._log = tempfile.TemporaryFile(mode="w+")
        cmd = [str(python), str(script), "--model-dir", str(model_dir), "--dtype", dtype, "--serve", *extra]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, bufsize=1)
        try:
            ready = self._answer()
        except PeerFailed:
            self.close()
            raise
        self.version: str = ready.get("version", "?")
        self.startup_seconds: float = ready.get("startup_seconds", 0.0)

    def run(self, name: str, requests: list[dict]) -> dict:
        """Time one request set once: peer_vllm.timed's report (seconds, outputs, tokens)."""
        self._proc.stdin.write(json.dumps({"name": name, "requests": requests}) + "\n")
        self._proc.stdin.flush()
        answer = self._answer()
        if answer.get("name") != name:
            raise PeerFailed(f"vLLM answered {answer.get('name')!r} for {name!r}")
        return answer

    def _answer(self) -> dict:
        """The next `RESULT` line (vLLM's own log lines on stdout are skipped)."""
        for line in self._proc.stdout:
            if line.startswith(RESULT):
                answer = json.loads(line[len(RESULT):])
                if "error" in answer:
                    raise PeerFailed(f"vLLM peer: {answer['error']}")
                return answer
        self._proc.wait()
        self._log.seek(0)
        raise PeerFailed(f"vLLM peer exited ({self._proc.returncode}) without an answer:\n{self._log.read()[-1500:]}")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()     # the peer's loop ends at EOF and it exits on its own
            try:
                self._proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> VllmSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start(python: Path, model_dir: Path, dtype: str) -> VllmSession | None:
    """A session, or None with the reason on stderr (the bench then reports ours alone)."""
    try:
        return VllmSession(python, model_dir, dtype)
    except (PeerFailed, OSError) as err:
        print(f"vLLM CPU failed to start: {err}", file=sys.stderr)
        return None
