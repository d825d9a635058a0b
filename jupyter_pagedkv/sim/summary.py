"""RunSummary: the figures one serving run is judged by, computed the same way for a real engine
run and a simulated one so the two can be set side by side."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..core.stats import MIN_TAIL_SAMPLES, tail_name


@dataclass(frozen=True, slots=True)
class RequestTiming:
    request_id: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_output_tokens: int
    tenant: str | None = None

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def latency(self) -> float:
        return self.finish_s - self.arrival_s


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def tail(values, q: float = 99) -> float:
    """The value `tail_name` names: the q-th percentile, or the maximum below MIN_TAIL_SAMPLES."""
    values = list(values)
    if not values:
        return float("nan")
    return percentile(values, q) if len(values) >= MIN_TAIL_SAMPLES else float(max(values))


@dataclass
class RunSummary:
    """One run. `kv_utilisation` = tokens stored / slots reserved, time-weighted over busy steps."""

    label: str
    requests: list[RequestTiming]
    duration_s: float
    kv_utilisation: float
    max_concurrent: int
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def throughput(self) -> float:
        """Generated tokens per second of the whole run."""
        return self.num_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s > 0 else 0.0

    def ttft(self, q: float) -> float:
        return percentile([r.ttft for r in self.requests], q)

    def latency(self, q: float) -> float:
        return percentile([r.latency for r in self.requests], q)

    @property
    def tail_name(self) -> str:
        """"P99", or "max" for a run of fewer than MIN_TAIL_SAMPLES requests."""
        return tail_name(len(self.requests))

    def ttft_tail(self) -> float:
        """TTFT at `tail_name`: P99, or the maximum of a small run."""
        return tail(r.ttft for r in self.requests)

    def latency_tail(self) -> float:
        """End-to-end latency at `tail_name`: P99, or the maximum of a small run."""
        return tail(r.latency for r in self.requests)

    def line(self) -> str:
        t = self.tail_name.lower()
        return (f"{self.label:<28} util {self.kv_utilisation:6.1%}  max conc {self.max_concurrent:4d}  "
                f"{self.throughput:8.1f} tok/s  TTFT p50 {self.ttft(50):7.2f}s {t} {self.ttft_tail():7.2f}s  "
                f"e2e p50 {self.latency(50):7.2f}s {t} {self.latency_tail():7.2f}s  preempt {self.num_preemptions}")


def capacity_at(rates: Sequence[float], values: Sequence[float], bound: float) -> float | None:
    """The highest request rate whose `values` (a latency, rising with rate) stay within `bound`,
    interpolated linearly between the last swept rate under the bound and the first one over it.
    None if even the lowest rate exceeds it; the highest rate swept, if none does (the sweep was
    too short to say more)."""
    if len(rates) != len(values) or not rates:
        raise ValueError("rates and values must be non-empty and of the same length")
    points = sorted(zip(rates, values))
    if points[0][1] > bound:
        return None
    for (r0, v0), (r1, v1) in zip(points, points[1:]):
        if v1 > bound:
            return r0 + (bound - v0) / (v1 - v0) * (r1 - r0)
    return points[-1][0]


class UtilisationMeter:
    """Time-weighted mean of tokens stored / slots reserved, fed once per step."""

    def __init__(self) -> None:
        self.stored = 0.0
        self.reserved = 0.0

    def add(self, tokens_stored: int, slots_reserved: int, dt: float) -> None:
        self.stored += tokens_stored * dt
        self.reserved += slots_reserved * dt

    @property
    def value(self) -> float:
        return self.stored / self.reserved if self.reserved else float("nan")
