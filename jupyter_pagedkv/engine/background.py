"""StepLoop: the engine's background thread, stepping whenever there is work.

Cells, widgets and several concurrent requests share one engine: the loop waits on the engine's
condition variable (notified by `add_request`), steps while the scheduler has work, and yields
the lock between steps so a monitor asking for stats never starves. `held()` keeps it from
stepping while a caller adds several requests, without holding the engine's lock: a request's
set-up (tokenizing, a grammar's compile, a draft model's load) runs outside that lock, and views
stay live meanwhile.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from typing import Callable, Iterator

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, step: Callable[[], object], has_work: Callable[[], bool],
                 work: threading.Condition, on_death: Callable[[BaseException], None]) -> None:
        self._step, self._has_work, self._work, self._on_death = step, has_work, work, on_death
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_error: str | None = None
        self._holds: Counter[int] = Counter()      # thread id -> open `held()` blocks

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._work:
            if self.is_running:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._work:
            self._stopping = True
            self._work.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No step starts inside the block (one under way when it opens finishes first), so what
        is added inside is all queued before the next step; re-entrant, per thread."""
        me = threading.get_ident()
        with self._work:
            self._holds[me] += 1
        try:
            yield
        finally:
            with self._work:
                self._holds[me] -= 1
                if not self._holds[me]:
                    del self._holds[me]
                self._work.notify_all()

    def held_here(self) -> bool:
        """Whether the calling thread is inside `held()` (where waiting on the loop never ends)."""
        with self._work:
            return threading.get_ident() in self._holds

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:   # only what Exception does not cover (SystemExit, ...)
            logger.error("the engine loop died (%s); its live requests end with the error",
                         type(err).__name__, exc_info=True)
            self._on_death(err)

    def _serve(self) -> None:
        while True:
            # The step runs under the lock the check took (it is re-entrant), so no `held()` can
            # open between the check and the step.
            with self._work:
                while not self._stopping and (self._holds or not self._has_work()):
                    self._work.wait()
                if self._stopping:
                    return
                try:
                    self._step()
                    self._last_error = None
                except Exception as err:
                    # A failed forward or sampler failed its requests (each carries the error and
                    # was logged with its id); anything else is logged here, once per distinct
                    # failure, and the loop keeps serving.
                    line = f"{type(err).__name__}: {err}"
                    if line != self._last_error and not getattr(err, "reported_by_engine", False):
                        logger.warning("engine step failed: %s", line, exc_info=True)
                    self._last_error = line
            # Python locks are not fair: without a yield here the loop re-takes the lock before a
            # waiting thread (a monitor asking for stats) wakes, which then starves for seconds.
            time.sleep(0)
