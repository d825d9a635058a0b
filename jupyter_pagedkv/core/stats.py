"""The engine's gauges: one definition of every number a monitor, `%pagedkv status` or a
benchmark shows, computed in one place (under the engine's lock, as one snapshot)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Gauges and counters, defined precisely (blocks and tokens are physical, counted once).

    num_free: blocks holding nothing reusable; num_cached: ref 0 but holding a reusable prefix;
    num_used: ref >= 1; num_shared: ref >= 2; kv_cache_usage = num_used / num_blocks;
    num_block_refs: sum of ref counts, so num_block_refs - num_used blocks are saved by sharing.
    tokens_stored: distinct slots holding KV of live sequences; slots_allocated = num_used x
    block_size; internal_waste = slots_allocated - tokens_stored.
    prefix_cache_queries / _hits: prompt tokens looked up / found in the cache at admission.
    spec_proposed_tokens / spec_accepted_tokens: draft tokens verified / kept (speculative
    decoding); spec_acceptance_rate = accepted / proposed; spec_num_verifications: sequence-steps
    that verified drafts; spec_mean_accepted_length = accepted / verifications (drafts kept per
    verification, the target's own token not counted: tokens per forward = 1 + this).
    """

    num_blocks: int
    block_size: int
    num_free: int
    num_used: int
    num_cached: int
    num_shared: int
    kv_cache_usage: float
    tokens_stored: int
    slots_allocated: int
    internal_waste: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_preemptions: int
    num_swapped_blocks: int
    tokens_per_s: float
    num_generated_tokens: int
    num_finished: int
    latency_percentiles: dict[str, dict[str, float]] = field(default_factory=dict)
    # Sum of ref counts = blocks the live sequences would hold if none were shared (private copies).
    num_block_refs: int = 0
    spec_num_verifications: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def summary(self) -> str:
        """A few human lines, for the terminal demo and `%pagedkv status`."""
        lines = [
            f"blocks: {self.num_used} used ({self.num_shared} shared), {self.num_cached} cached, "
            f"{self.num_free} free of {self.num_blocks} x {self.block_size} tokens "
            f"(KV usage {self.kv_cache_usage:.1%})",
            f"waste: {self.internal_waste} of {self.slots_allocated} allocated slots unused "
            f"({self.tokens_stored} tokens stored)",
            f"prefix cache: {self.prefix_cache_hits} / {self.prefix_cache_queries} prompt tokens hit "
            f"({self.prefix_hit_rate:.1%})",
            f"requests: {self.num_running} running, {self.num_waiting} waiting, "
            f"{self.num_finished} finished, {self.num_preemptions} preemptions",
            f"recent throughput: {self.tokens_per_s:.1f} generated tokens/s (last 10 s of steps)",
        ]
        if self.spec_proposed_tokens:
            lines.append(f"speculative: {self.spec_accepted_tokens} / {self.spec_proposed_tokens} draft "
                         f"tokens accepted ({self.spec_acceptance_rate:.1%}), "
                         f"{self.spec_mean_accepted_length:.2f} per verification")
        ttft = self.latency_percentiles.get("ttft")
        if ttft:
            lat = self.latency_percentiles["latency"]
            lines.append(f"latency: TTFT p50 {ttft['p50']*1e3:.0f} ms / p99 {ttft['p99']*1e3:.0f} ms, "
                         f"end-to-end p50 {lat['p50']:.2f} s / p99 {lat['p99']:.2f} s")
        return "\n".join(lines)
