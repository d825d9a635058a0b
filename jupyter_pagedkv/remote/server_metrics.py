"""A vLLM server's Prometheus `/metrics`, read as the same gauges our engine reports.

The names are those vLLM 0.32 (V1 engine) exposes; every series carries `model_name` and
`engine` labels, so values are summed over the series of the served model. What the server does
not expose (reference counts, slots per block) is left at zero and said so in `summary()`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.stats import EngineStats, latency_line

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Gauges and counters we read, each with the older name some vLLM versions use.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
GENERATED = ("vllm:generation_tokens_total",)
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
FINISHED = ("vllm:request_success_total",)
CACHE_INFO = ("vllm:cache_config_info",)


@dataclass
class Sample:
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> dict[str, list[Sample]]:
    """Prometheus text format -> {metric name: samples}; comments and malformed lines are skipped."""
    out: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        out.setdefault(m.group(1), []).append(Sample(labels, value))
    return out


@dataclass
class ServerMetrics:
    """One scrape, filtered to one served model (series of other models are ignored)."""

    samples: dict[str, list[Sample]]
    model: str | None = None

    def _series(self, names: tuple[str, ...]) -> list[Sample] | None:
        for name in names:
            if name in self.samples:
                return [s for s in self.samples[name]
                        if self.model is None or s.labels.get("model_name", self.model) == self.model]
        return None

    def value(self, names: tuple[str, ...], default: float = 0.0) -> float:
        series = self._series(names)
        return sum(s.value for s in series) if series else default

    def has(self, names: tuple[str, ...]) -> bool:
        return self._series(names) is not None

    def cache_info(self) -> dict[str, str]:
        """Labels of `cache_config_info`: block_size, num_gpu_blocks (the CPU build's blocks too)."""
        series = self._series(CACHE_INFO)
        return dict(series[0].labels) if series else {}


@dataclass
class RemoteStats(EngineStats):
    """EngineStats from a server: what /metrics and the KV events tell, zero where they are silent."""

    source: str = ""
    kv_event_blocks: int | None = None     # full blocks in the server's prefix cache (events)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"server: {self.source}",
            f"blocks: {self.num_used} used of {self.num_blocks} x {self.block_size} tokens "
            f"(KV usage {self.kv_cache_usage:.1%}, from /metrics)",
            f"prefix cache: {self.prefix_cache_hits} / {self.prefix_cache_queries} prompt tokens hit "
            f"({self.prefix_hit_rate:.1%})",
            f"requests: {self.num_running} running, {self.num_waiting} waiting, "
            f"{self.num_finished} finished, {self.num_preemptions} preemptions",
            f"throughput: {self.tokens_per_s:.1f} generated tokens/s (between the last two reads), "
            f"{self.num_generated_tokens} generated in all",
        ]
        if self.kv_event_blocks is not None:
            lines.append(f"KV events: {self.kv_event_blocks} full blocks in the server's prefix cache")
        latency = latency_line(self.latency_percentiles)
        if latency:
            lines.append(f"latency (this client's requests): {latency}")
        lines += self.notes
        return "\n".join(lines)
