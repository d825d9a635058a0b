"""The kernel-wide state behind the magics: one engine, the chat sessions, the background jobs.

One `KernelSession` lives per kernel process (`current()`), so every cell, the monitor channel and
background threads see the same engine. Nothing here imports torch until a model is loaded.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from ..worker.host_memory import return_freed_memory, rss_bytes

if TYPE_CHECKING:
    from ..engine.outputs import RequestOutput
    from ..protocol import EngineClient
    from .streaming import BackgroundJob

NO_ENGINE = "no model loaded: run `%pagedkv load` (the embedded SmolLM2-135M-Instruct) or `%pagedkv load MODEL`"


def release_freed_memory() -> None:
    """Collect garbage and ask glibc to hand freed heap pages back to the OS (no-op elsewhere)."""
    gc.collect()
    return_freed_memory()


def preflight(model: str | None, device: str, dtype: str, revision: str | None = None,
              trust_remote_code: bool = False, weights: str = "dense") -> None:
    """Catch a mistyped model, device or dtype before the current engine is unloaded for it.

    A hub id is fetched here (downloaded on first use, with the hub's progress bars), so a wrong
    id, a gated repo or a missing network leaves the loaded engine in place. Packed weights: the
    device, the dtype and the GGUF path (not its header: the load reads that). Raises ValueError
    with the loader's wording; the full checks still happen while loading."""
    from ..worker.loader import check_packed, choose_dtype, embedded_gguf, locate

    import torch
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here; use --device cpu or auto")
    if weights == "packed":
        check_packed(model, device, dtype)
        return
    if model is None:
        embedded_gguf()
    else:
        locate(model, revision, trust_remote_code)
    if dtype != "auto":
        choose_dtype(device, dtype)          # the loader's own check, and its wording


@dataclass
class ChatSession:
    """One multi-turn conversation, kept both as text and as the exact tokens the model saw.

    The next turn's prompt is `token_ids` (previous prompt + the reply's tokens as generated) plus
    the template's continuation, so the cached blocks of the previous turn match as a prefix; when
    the template rewrites earlier turns (the kept tokens are no longer a prefix of the re-templated
    text), the conversation is re-templated from text instead.
    """

    name: str
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    reused_tokens: bool = False   # whether the last prompt extended token_ids (vs re-templated)
    tenant: str | None = None     # a conversation belongs to one tenant, fixed by its first turn

    @property
    def num_turns(self) -> int:
        return len(self.outputs)

    def conversation(self, user_message: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages + [{"role": "user", "content": user_message}]

    def prompt_ids(self, engine: EngineClient, user_message: str):
        """The next prompt; extends the previous turn's tokens when the template allows (so they
        hit the prefix cache), else the conversation templated afresh (a server: by the server)."""
        prompt, self.reused_tokens = engine.chat_prompt(self.conversation(user_message), self.token_ids)
        return prompt

    def record(self, user_message: str, output: RequestOutput) -> None:
        """Keep a finished turn; an aborted one is dropped as if never sent."""
        if output.finish_reason == "abort":
            return
        self.messages += [{"role": "user", "content": user_message},
                          {"role": "assistant", "content": output.text}]
        self.token_ids = list(output.prompt_token_ids) + list(output.token_ids)
        self.outputs.append(output)

    def forget_tokens(self) -> None:
        """After a model change the kept token ids mean nothing: re-template from text next turn."""
        self.token_ids = []


@dataclass
class KernelSession:
    """The engine of this kernel plus what the magics track around it."""

    engine: EngineClient | None = None
    chats: dict[str, ChatSession] = field(default_factory=dict)
    jobs: list[BackgroundJob] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)   # request id -> "generate", "chat NAME", ...
    rss_before_load: int = 0      # RSS after importing torch + transformers, before any weights
    load_seconds: float = 0.0
    local_engine: EngineClient | None = None   # kept aside while `engine` is a server client
    connected: bool = False                  # `engine` is a server client (`%pagedkv connect`)

    def connect(self, url: str, **kwargs: Any) -> Any:
        """Point the magics at a vLLM server; the local engine (if any) waits for `disconnect`."""
        from ..remote.client import RemoteEngine
        client = RemoteEngine(url, **kwargs)   # raises before anything changes here
        if self.connected:
            self.engine.shutdown()
        else:
            self.local_engine = self.engine
        self.engine, self.connected = client, True
        for chat in self.chats.values():
            chat.forget_tokens()
        return client

    def disconnect(self) -> Any:
        """Back to the local engine (None if none was loaded); returns the closed client."""
        if not self.connected:
            return None
        client, self.engine, self.local_engine = self.engine, self.local_engine, None
        self.connected = False
        client.shutdown()
        for chat in self.chats.values():
            chat.forget_tokens()
        return client

    def require_engine(self) -> EngineClient:
        if self.engine is None:
            raise UsageError(NO_ENGINE)
        return self.engine

    def load(self, model: str | None, progress: bool = True, **engine_kwargs: Any) -> EngineClient:
        """Replace the engine: unload the old one first (its memory back), then load and start."""
        preflight(model, engine_kwargs.get("device", "auto"), engine_kwargs.get("dtype", "auto"),
                  engine_kwargs.get("revision"), engine_kwargs.get("trust_remote_code", False),
                  engine_kwargs.get("weights", "dense"))
        self.disconnect()
        # What the old model cached, so `why` on the new one says "another model" for it.
        ledger = self.engine.prefix_ledger() if self.engine is not None else None
        if self.engine is not None:
            self.unload()
        from .progress import Stages

        t0 = time.perf_counter()
        bar = Stages(3, "importing torch + transformers", enabled=progress)
        try:
            import torch  # noqa: F401  (the slow imports, shown as their own stage)
            import transformers  # noqa: F401
            if not self.rss_before_load:
                self.rss_before_load = rss_bytes()   # the level `unload` should return to
            bar.next(f"loading {model or 'SmolLM2-135M-Instruct'} + allocating the KV cache")
            from ..engine.engine import Engine
            engine = Engine.from_pretrained(model, **engine_kwargs)
            engine.prefix_ledger(ledger)
            bar.next("starting the engine thread")
            engine.start()
        finally:
            bar.close()
        self.engine = engine
        self.load_seconds = time.perf_counter() - t0
        for chat in self.chats.values():
            chat.forget_tokens()
        return engine

    def unload(self) -> tuple[int, int]:
        """Shut the engine down and drop every reference to it; returns RSS (before, after)."""
        self.disconnect()   # connected: the model to release is the local one kept aside
        before = rss_bytes()
        engine, self.engine = self.engine, None
        if engine is None:
            return before, before
        engine.shutdown()
        for job in self.jobs:
            job.wait(timeout=5.0)
        self.jobs = [j for j in self.jobs if not j.done.is_set()]
        del engine
        release_freed_memory()
        return before, rss_bytes()

    def summary_line(self) -> str:
        """Model, device, dtype, blocks x block size = capacity, bytes per block, KV memory."""
        return self.require_engine().info().summary

    def chat(self, name: str) -> ChatSession:
        return self.chats.setdefault(name, ChatSession(name))

    def live_jobs(self) -> list[BackgroundJob]:
        return [j for j in self.jobs if not j.done.is_set()]

    def wait_background(self, timeout: float | None = None) -> bool:
        """Block until every background job is done (tests, scripts); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self.jobs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait(left):
                return False
        return True


_current: KernelSession | None = None


def current() -> KernelSession:
    """The session of this kernel, created on first use."""
    global _current
    if _current is None:
        _current = KernelSession()
    return _current
