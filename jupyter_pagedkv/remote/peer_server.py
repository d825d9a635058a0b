"""Start a local vLLM OpenAI-compatible server from the peer venv, for `%pagedkv connect` and tests.

    python -m jupyter_pagedkv serve [--port 8000] [--kv-events-port 5557]   # key: $VLLM_API_KEY or --api-key

serves the embedded SmolLM2-135M-Instruct (its cached plain Hugging Face folder, the one the local
engine loads) as model `smollm2`, fp32, eager, block size 32, with prefix caching, cached-token
usage details and (optionally) KV events on ZMQ. It prints the exact `vllm` command line first,
its key hidden.
The peer venv comes from `make bench-peers` (docs/peers.md); this module never imports vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SERVED_NAME = "smollm2"
REPO_ROOT = Path(__file__).resolve().parents[2]


def peer_python(root: Path = REPO_ROOT) -> Path | None:
    """The peer venv's interpreter once `make bench-peers` finished (its stamp exists), else None."""
    venv = root / ".venv-peers"
    py = venv / "bin" / "python"
    return py if py.exists() and (venv / ".ok").exists() else None


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free localhost port below the ephemeral range: vLLM binds random ephemeral ports for its
    own processes while starting, and once took the one we had picked (Address already in use)."""
    import random
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


@dataclass
class ServerConfig:
    model_dir: str
    port: int = 8000
    kv_events_port: int | None = None
    api_key: str | None = None
    served_name: str = SERVED_NAME
    dtype: str = "float32"
    block_size: int = 32            # vLLM's CPU attention takes multiples of 32 only
    kv_space_gib: int = 1
    max_model_len: int = 2048
    max_num_seqs: int = 32
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        return None if self.kv_events_port is None else f"tcp://127.0.0.1:{self.kv_events_port}"

    def argv(self, python: str | Path) -> list[str]:
        """The server command line (vLLM's own api_server entry point, same as `vllm serve`)."""
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", self.dtype, "--block-size", str(self.block_size),
               "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
               # eager: compiling costs 60-75 s per start on this machine, for no gain at this size.
               "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
               # usage.prompt_tokens_details.cached_tokens in every response.
               "--enable-prompt-tokens-details"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.kv_events_port is not None:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{self.kv_events_port}", "topic": "kv"}
            cmd += ["--kv-events-config", json.dumps(cfg)]
        return cmd + list(self.extra)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_space_gib)
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "jupyter-pagedkv-vllm-cache"))
        # No network: fail fast instead of hub look-ups and usage reports. Dev mode adds
        # /reset_prefix_cache, which the block-map test uses to start from an empty cache.
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK",
                     "VLLM_SERVER_DEV_MODE"):
            env.setdefault(name, "1")
        return env


class PeerServer:
    """One vLLM server process group: started, waited on (/health), stopped (the whole group)."""

    def __init__(self, config: ServerConfig, python: str | Path, log_path: str | Path) -> None:
        self.config = config
        self.python = python
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self) -> PeerServer:
        log = open(self.log_path, "wb")
        # Own session: vLLM forks an engine-core and a worker process; stop() signals them all.
        self.proc = subprocess.Popen(self.config.argv(self.python), env=self.config.env(), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Poll /health until it answers 200; raises RuntimeError with the log's tail otherwise."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self.proc.returncode} while starting: "
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.config.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - t0
                        return self.startup_s
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM did not become healthy within {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:])

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)
        # The engine-core and worker share the group; make sure none is left behind.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def redacted(argv: list[str]) -> list[str]:
    """A command line as it may be printed: the value after --api-key hidden."""
    return [("<hidden>" if i and argv[i - 1] == "--api-key" else a) for i, a in enumerate(argv)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-events-port", type=int, default=None)
    p.add_argument("--api-key", default=None, help="the key the server requires (default: $VLLM_API_KEY)")
    p.add_argument("--kv-space-gib", type=int, default=1)
    args = p.parse_args(argv)
    py = peer_python()
    if py is None:
        p.error("no peer venv: run `make bench-peers` first (vLLM's CPU build, ~3.5 min)")
    from ..worker.loader import embedded_model_dir
    key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    cfg = ServerConfig(str(embedded_model_dir()), args.port, args.kv_events_port, key,
                       kv_space_gib=args.kv_space_gib)
    argv_ = cfg.argv(py)
    print("VLLM_CPU_KVCACHE_SPACE=%d VLLM_SERVER_DEV_MODE=1 %s" % (cfg.kv_space_gib, shlex.join(redacted(argv_))),
          flush=True)
    extra = f" --kv-events {cfg.kv_events_endpoint}" if cfg.kv_events_endpoint else ""
    hint = " (with VLLM_API_KEY set to the server's key in the kernel's environment)" if key else ""
    print(f"then, in a notebook: %pagedkv connect {cfg.url}{extra}{hint}", flush=True)
    try:
        return subprocess.call(argv_, env=cfg.env())
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
