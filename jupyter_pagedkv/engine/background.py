"""StepLoop: the engine's background thread, stepping whenever there is work.

Cells, widgets and several concurrent requests share one engine: the loop waits on the engine's
condition variable (notified by `add_request`), steps while the scheduler has work, and yields
the lock between steps so a monitor asking for stats never starves.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, step: Callable[[], object], has_work: Callable[[], bool],
                 work: threading.Condition, on_death: Callable[[BaseException], None]) -> None:
        self._step, self._has_work, self._work, self._on_death = step, has_work, work, on_death
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_error: str | None = None

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

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:   # only what Exception does not cover (SystemExit, ...)
            logger.error("the engine loop died (%s); its live requests end with the error",
                         type(err).__name__, exc_info=True)
            self._on_death(err)

    def _serve(self) -> None:
        while True:
            with self._work:
                while not self._stopping and not self._has_work():
                    self._work.wait()
                if self._stopping:
                    return
            try:
                self._step()
                self._last_error = None
            except Exception as err:
                # A failed forward or sampler failed its requests (each carries the error and was
                # logged with its id); anything else is logged here, once per distinct failure,
                # and the loop keeps serving.
                line = f"{type(err).__name__}: {err}"
                if line != self._last_error and not getattr(err, "reported_by_engine", False):
                    logger.warning("engine step failed: %s", line, exc_info=True)
                self._last_error = line
            # Python locks are not fair: without a yield here the loop re-takes the lock before a
            # waiting thread (a monitor asking for stats) wakes, which then starves for seconds.
            time.sleep(0)
