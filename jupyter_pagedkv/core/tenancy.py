"""Tenancy: who holds the pool, what each tenant may hold, and whose work goes next.

A tenant is the name a request was sent under (None: nobody named; that is one tenant too). The
KV-cache manager answers how many distinct blocks each tenant references (`num_held`, a counter
the pool keeps), so everything here is O(tenants) per decision. Three policies drive the Scheduler,
alternatives of one option (`scheduling_policy`): each answers the same questions (who comes in
next, whom a dry pool preempts, whom a candidate that does not fit may preempt) differently.

- "fcfs": work goes in queue order (priority, then arrival), swapped work first, all running
  work before any new; a pool running dry preempts the last in queue order (lowest priority,
  newest), whoever sent it. Priority only orders the queues: a waiting request never preempts.
- "priority" (vLLM's): preemptive priority. Running and candidate work are served in one queue
  order (running work of equal or higher priority first), and a candidate that does not fit
  preempts running work of strictly lower priority (lowest, newest first) when that makes it fit
  (invariant 11, docs/design.md). Equal priorities never preempt each other, so they cannot
  take turns. Tenants' weights play no part (that is "fair"); their caps still hold.
- "fair": weighted fair share of the KV pool. A tenant's share is weight / sum of the weights of
  the tenants with live work, times the pool; its usage is blocks held / weight. The tenant with
  the least usage goes next (its swapped work, then its waiting work, in queue order); a pool
  running dry preempts inside the tenant furthest over its share; and a tenant under its share
  whose next request does not fit makes room by preempting a tenant over its share, never one
  under it (so two tenants cannot take turns preempting each other).

Under either policy `max_blocks` is a hard cap: a tenant at its cap waits, or has its own newest
sequence preempted, and nobody else's work waits on it (invariant 8, docs/design.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from .sampling_params import show

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManager
    from .sequence import Sequence

POLICIES = ("fcfs", "fair", "priority")


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """What a tenant is entitled to: a weight in the fair share, and an optional hard cap."""

    name: str | None
    weight: float = 1.0
    max_blocks: int | None = None


def queue_order(seq: Sequence) -> tuple:
    """Queue order: lower priority numbers first, then arrival; the last in this order (lowest
    priority, newest) is the one preempted first."""
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Tenancy:
    """The tenants' specs and the policy's decisions, over the memory's per-tenant counts."""

    def __init__(self, kv: KVCacheManager, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {show(policy)}")
        self.kv = kv
        self.policy = policy
        self.specs: dict[str | None, TenantSpec] = {}

    @property
    def fair(self) -> bool:
        return self.policy == "fair"

    @property
    def by_priority(self) -> bool:
        """Running work is served in queue order, interleaved with candidates (see above)."""
        return self.policy == "priority"

    def set(self, name: str | None, weight: float = 1.0, max_blocks: int | None = None) -> TenantSpec:
        """Register or change a tenant (the caller checks the values; see `check_spec`)."""
        spec = TenantSpec(name, float(weight), max_blocks)
        self.specs[name] = spec
        return spec

    def spec(self, name: str | None) -> TenantSpec:
        return self.specs.get(name) or TenantSpec(name)

    def held(self, name: str | None) -> int:
        return self.kv.num_held(name)

    def usage(self, name: str | None) -> float:
        """Blocks held per unit of weight: the fair policy serves the smallest first."""
        return self.held(name) / self.spec(name).weight

    def share(self, name: str | None, active: Iterable[str | None]) -> float:
        """`name`'s fair share of the pool in blocks, among the tenants in `active` (and itself)."""
        total = sum(self.spec(t).weight for t in set(active) | {name})
        return self.kv.num_blocks * self.spec(name).weight / total

    def over_cap(self, name: str | None, extra: int) -> bool:
        """Whether holding `extra` more blocks would take `name` past its max_blocks."""
        if extra <= 0:
            return False
        cap = self.spec(name).max_blocks
        return cap is not None and self.held(name) + extra > cap

    # -- decisions ------------------------------------------------------------------------------
    def next_candidate(self, swapped: Iterable[Sequence], waiting: Iterable[Sequence],
                       blocked: set) -> Sequence | None:
        """The sequence to bring in next (swap in or admit), skipping tenants in `blocked` (at
        their cap this step). Queues are in (priority, arrival) order already; "priority" takes
        the earlier of the two queues' heads, the others swapped work first."""
        ok = lambda s: s.tenant not in blocked
        if not self.fair:
            heads = [next((s for s in queue if ok(s)), None) for queue in (swapped, waiting)]
            heads = [s for s in heads if s is not None]
            if self.by_priority and heads:
                return min(heads, key=queue_order)
            return heads[0] if heads else None
        heads: dict[str | None, Sequence] = {}
        for queue in (swapped, waiting):   # within a tenant, swapped work comes back first
            for seq in queue:
                if ok(seq) and seq.tenant not in heads:
                    heads[seq.tenant] = seq
        if not heads:
            return None
        return min(heads.values(), key=lambda s: (self.usage(s.tenant), s.priority, s.arrival_time, s.seq_id))

    def victim(self, running: list[Sequence], tenant: object = ...) -> Sequence | None:
        """Whom to preempt: inside `tenant` when given (its cap), else under "fair" inside the
        tenant furthest over its share, else the last in queue order of all."""
        if tenant is ...:
            if not self.fair:
                return max(running, key=queue_order, default=None)
            tenant = max({s.tenant for s in running}, key=self.usage, default=None)
        return max((s for s in running if s.tenant == tenant), key=queue_order, default=None)

    def lower_priority(self, pending: list[Sequence], cand: Sequence) -> list[Sequence]:
        """Under "priority": the running sequences in `pending` (in queue order) that `cand` may
        preempt to fit: those of strictly lower priority; none under other policies."""
        return [s for s in pending if s.priority > cand.priority] if self.by_priority else []

    def over_share(self, running: list[Sequence], active: set, beside: str | None) -> Sequence | None:
        """Under "fair": a victim from the tenant furthest over its share other than `beside`,
        or None when no such tenant holds more than its share."""
        over = {s.tenant for s in running if s.tenant != beside
                and self.held(s.tenant) > self.share(s.tenant, active)}
        return self.victim(running, max(over, key=self.usage)) if over else None

def check_spec(name: object, weight: object, max_blocks: object) -> None:
    """One clear line for each way a tenant's spec can be wrong."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"tenant must be a non-empty string such as 'alice', got {show(name)}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"tenant {name!r}: weight must be a positive number (its share is weight / "
                         f"sum of weights), got {show(weight)}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int)
                                   or max_blocks < 1):
        raise ValueError(f"tenant {name!r}: max_blocks must be a positive whole number of blocks "
                         f"(or None for no cap), got {show(max_blocks)}")
