"""One vLLM CPU process kept alive across a benchmark, so its runs can interleave with ours.

`bench throughput --shapes` used to run all of our engine's shapes, then start vLLM once for all
of its own: the two blocks ran ten minutes apart, and this host's drift over that time landed in
the ratio (the same code read 1.51x and 2.07x two hours apart: docs/benchmarks.md, sixth
measurement). With a session, vLLM starts once (its start-up costs a minute or more) and then
runs each request set when asked, right beside our run of the same set.

The peer is peer_vllm.py `--serve` in its own venv (it cannot import us); the protocol is in its
docstring. Its stderr (and vLLM's logs) go to a temporary file, so a chatty peer cannot fill a
pipe and stall; its stdout is read by a thread, so every wait has a deadline even when vLLM's
engine-core child keeps the pipe open after the peer itself died.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .peer_vllm import RESULT

PEER = Path(__file__).with_name("peer_vllm.py")
START_TIMEOUT_S = 900.0     # vLLM's start-up: 1-3 minutes on these hosts
RUN_TIMEOUT_S = 3600.0      # one request set: the longest shape takes ~3 minutes


class PeerFailed(RuntimeError):
    """The peer exited, hung or answered with an error; the message carries its stderr's tail."""


class VllmSession:
    """`with VllmSession(python, model_dir, dtype) as peer: peer.run(name, requests)`."""

    def __init__(self, python: Path | str, model_dir: Path, dtype: str, script: Path = PEER,
                 extra: tuple[str, ...] = (), start_timeout: float = START_TIMEOUT_S,
                 run_timeout: float = RUN_TIMEOUT_S) -> None:
        self.run_timeout = run_timeout
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc: subprocess.Popen | None = None
        try:
            cmd = [str(python), str(script), "--model-dir", str(model_dir), "--dtype", dtype, "--serve", *extra]
            # Its own process group: close() can then stop vLLM's engine-core and worker children too.
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                          text=True, bufsize=1, start_new_session=True)
            self._lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=self._read, daemon=True).start()
            ready = self._answer(start_timeout)
            if ready.get("ready") is not True:
                raise PeerFailed(f"vLLM peer's first answer was not its ready line: {ready}")
        except BaseException:
            self.close()
            raise
        self.version: str = ready.get("version", "?")
        self.startup_seconds: float = ready.get("startup_seconds", 0.0)

    def run(self, name: str, requests: list[dict]) -> dict:
        """Time one request set once: peer_vllm.timed's report (seconds, outputs, generated_tokens)."""
        try:
            self._proc.stdin.write(json.dumps({"name": name, "requests": requests}) + "\n")
            self._proc.stdin.flush()
        except OSError as err:          # the peer is gone (BrokenPipeError)
            raise PeerFailed(f"vLLM peer no longer reads its requests ({err}):\n{self._stderr_tail()}") from err
        answer = self._answer(self.run_timeout)
        if answer.get("name") != name:
            raise PeerFailed(f"vLLM answered {answer.get('name')!r} for {name!r}")
        return answer

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)           # end of stdout

    def _answer(self, timeout: float) -> dict:
        """The next `RESULT` line within `timeout` seconds (other lines on stdout are skipped)."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                tail = self._stderr_tail()
                self.close()
                raise PeerFailed(f"vLLM peer gave no answer in {timeout:.0f} s; stopped it:\n{tail}") from None
            if line is None:
                self._proc.wait()
                raise PeerFailed(f"vLLM peer exited ({self._proc.returncode}) without an answer:\n"
                                 f"{self._stderr_tail()}")
            if line.startswith(RESULT):
                try:
                    answer = json.loads(line[len(RESULT):])
                except ValueError as err:
                    raise PeerFailed(f"vLLM peer's answer is not JSON ({err}): {line[:200]!r}") from err
                if "error" in answer:
                    raise PeerFailed(f"vLLM peer: {answer['error']}")
                return answer

    def _stderr_tail(self) -> str:
        if self._log.closed:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-1500:]

    def close(self) -> None:
        """Closing stdin ends the peer's loop and it exits on its own; a peer still up after
        `grace` seconds (vLLM shuts its engine-core process down first: a few seconds) is killed
        with its whole process group, so no vLLM child outlives the benchmark."""
        proc, grace = self._proc, 60
        if proc is not None:
            if proc.poll() is None:
                try:
                    proc.stdin.close()
                    proc.wait(timeout=grace)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)    # children the peer left behind, if any
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if not self._log.closed:
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
