"""EngineClient: what a magic, a widget, a monitor or a benchmark may call on an engine, local
(`Engine`) or a server's (`RemoteEngine`), and the read-only views it gets back.

Front ends depend on this interface, never on an engine's private fields: no lock, no scheduler
queue, no pool. Both implementations satisfy it (tests/test_architecture.py checks them), so a
view written against it draws a server exactly as it draws the kernel's own engine.
"""
from __future__ import annotations

import queue
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, Iterator, Protocol, Self, Sequence, runtime_checkable

from .core.miss_report import MissReport, PrefixLedger
from .core.sampling_params import SamplingParams
from .core.stats import EngineStats
from .engine.block_tables import SeqBlocks
from .engine.outputs import EngineInfo, Observation, RequestOutput, RequestRow, StreamDelta

__all__ = ["EngineClient", "EngineInfo", "EngineStats", "EngineUnavailable", "Observation", "RequestOutput",
           "RequestRow", "SeqBlocks", "StepObserver", "StreamDelta"]


class EngineUnavailable(RuntimeError):
    """The engine could not serve (a network or server failure, not the caller's mistake); its
    message is one line that says what to do, so a front end shows it without a traceback."""


@runtime_checkable
class EngineClient(Protocol):
    name: str

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, listener: queue.SimpleQueue | None = None,
                    tenant: str | None = None) -> str:
        """Queue one request; its StreamDeltas go to `listener`. Bad input: ValueError, one line.
        `tenant` names who sent it (prefix isolation under prefix_cache_scope="tenant")."""

    def admission(self) -> AbstractContextManager[None]:
        """Requests added inside `with client.admission():` are queued before the engine's next
        step (GenerationFront.admission); add only, wait after the block."""

    def abort(self, request_id: str) -> bool:
        """Cancel a live request and free what it holds; False if it was not live."""

    def has_unfinished_requests(self) -> bool: ...

    def generate(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, tenant: str | None = None,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]: ...

    def chat(self, messages: Any, params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, tenant: str | None = None) -> list[RequestOutput]: ...

    def stream(self, prompt: Any, params: SamplingParams | None = None,
               request_id: str | None = None, tenant: str | None = None) -> Iterator[StreamDelta]: ...

    @property
    def has_chat_template(self) -> bool: ...

    def apply_chat_template(self, messages: list[dict]) -> Any:
        """A prompt for `add_request` from a conversation (token ids, or the conversation itself
        for a server that templates it)."""

    def chat_prompt(self, messages: list[dict], previous: list[int] | None = None) -> tuple[Any, bool]:
        """The next prompt of a conversation and whether it extends `previous` (cache reuse)."""

    def set_tenant(self, name: str, weight: float = 1.0, max_blocks: int | None = None) -> None:
        """Tenant `name`'s weight in the fair share and its cap on blocks; ValueError, one line,
        for a bad spec or an engine that does not take them (a server applies its own policy)."""

    def add_drafter(self, speculative: Any) -> str:
        """Register a drafter for speculative decoding (ValueError where it cannot run)."""

    # -- running -----------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    # -- views -------------------------------------------------------------------------------------
    def info(self) -> EngineInfo: ...

    def stats(self) -> EngineStats: ...

    def pool_snapshot(self, block_ids: Iterable[int] | None = None) -> dict: ...

    def observe(self, full: bool = False) -> Observation:
        """Gauges plus the blocks changed since the last observation, in one consistent look."""

    def request_rows(self, finished: int = 20) -> list[RequestRow]: ...

    def block_tables(self) -> list[SeqBlocks]:
        """Every live sequence's block table, copied in one look (ValueError where the engine
        cannot report them: a server shows only its pool)."""

    def why(self, request_id: str | None = None) -> MissReport:
        """Why each prompt block of a request (None: the newest) hit the prefix cache or not, as
        found at its admission (ValueError, one line, where the engine cannot tell: a server)."""

    def prefix_ledger(self, previous: PrefixLedger | None = None) -> PrefixLedger:
        """This engine's model identity and cached chains (`previous`: an earlier engine's, whose
        chains `why` then names as another model's; `%pagedkv load` hands them over)."""

    def check_invariants(self) -> None: ...

    def reset_prefix_cache(self) -> int: ...

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Called after each step (a server client has no steps: a monitor then polls)."""

    def remove_step_listener(self, listener: Callable[[], None]) -> None: ...

    def add_shutdown_listener(self, listener: Callable[[], None]) -> None: ...

    def monitor(self, **kwargs: Any) -> Any:
        """The live block-pool widget of this engine."""


class StepObserver:
    """Base of the `with Reader(engine) as r: ...run...` objects that read an engine after every
    step (PoolRecorder, WasteMeter, FrameAt): entering adds `_on_step` as a step listener, leaving
    removes it, also when the run inside raised. `_on_step` runs in the stepping thread under the
    engine's lock, so what it reads describes one instant; it must stay cheap."""

    engine: EngineClient

    def __enter__(self) -> Self:
        self.engine.add_step_listener(self._on_step)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.remove_step_listener(self._on_step)

    def _on_step(self) -> None:
        raise NotImplementedError
