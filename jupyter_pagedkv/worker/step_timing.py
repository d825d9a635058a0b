"""Where one engine step's time goes: host scheduling, input preparation, the forward (as the
host saw it and as the device ran it), the wait for the device, sampling and bookkeeping.

Off by default (`engine.step_timings is None`); a benchmark sets it to a list. On CUDA the
forward's device time comes from CUDA events, since the host's clock around an asynchronous
forward measures only how long the kernel launches took.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch


@dataclass(slots=True)
class StepTiming:
    num_seqs: int               # sequences (chunks) in the step
    num_tokens: int             # tokens computed
    num_decode: int             # chunks of exactly one token
    schedule_s: float           # Scheduler.schedule + drafting, on the host
    prepare_s: float            # block copies / swaps and building the model inputs
    launch_s: float             # host wall time of the model call (CUDA: mostly kernel launches)
    device_s: float | None      # the forward's device time by CUDA events (None on the CPU)
    wait_s: float               # host waiting for the device after launching (CUDA only)
    sample_s: float             # sampling, appending tokens, stop rules, outputs
    total_s: float
    h2d_copies: int | None = None   # host -> device copies of step inputs (Triton path; None: not counted)
    mask_s: float = 0.0         # of sample_s: structured outputs' grammar masks (filled and applied)


class ForwardClock:
    """Times one forward: host wall clock always, CUDA events when the model is on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False           # events only while someone reads them
        self._events = None

    def start(self) -> None:
        self._events = None
        if self.cuda and self.enabled:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()

    def device_seconds(self) -> float | None:
        """The last forward's device time (synchronises with its end event)."""
        if self._events is None:
            return None
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


def summarize(timings: list[StepTiming], min_decode: int = 1) -> dict:
    """Medians (seconds) of each phase over decode-only steps of at least `min_decode` sequences,
    plus the fraction of a step the host spends outside the device's forward."""
    steps = [t for t in timings if t.num_decode == t.num_seqs and t.num_seqs >= min_decode]
    if not steps:
        return {"steps": 0}
    med = {k: statistics.median(getattr(t, k) for t in steps)
           for k in ("schedule_s", "prepare_s", "launch_s", "wait_s", "sample_s", "mask_s", "total_s")}
    device = [t.device_s for t in steps if t.device_s is not None]
    out = {"steps": len(steps), "median_batch": statistics.median(t.num_seqs for t in steps), **med}
    copies = [t.h2d_copies for t in steps if t.h2d_copies is not None]
    if copies:
        out["h2d_copies"] = statistics.median(copies)
    if device:
        out["device_s"] = statistics.median(device)
        # The step's host-only share: everything but the time the device spent on the forward.
        out["host_fraction"] = max(0.0, 1.0 - out["device_s"] / med["total_s"])
    return out


def as_rows(timings: list[StepTiming]) -> list[dict]:
    return [asdict(t) for t in timings]
