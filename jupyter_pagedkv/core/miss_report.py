"""Why a prompt's blocks missed the prefix cache, worked out once, at the request's first admission.

At admission the manager knows which leading blocks hit; `explain` names a cause for every other
prompt block from what the pool can tell at that instant, so the answer describes the cache the
request met, not the cache at the time someone asks:

- "partial": the last block is not full (only full blocks are ever cached);
- "last token": a full last block holds the prompt's last token, whose logits must be computed,
  so hits stop one token short (as vLLM's);
- "caching off": prefix caching is off (or the contiguous baseline, which shares nothing);
- "prompt logprobs": prompt_logprobs needs every prompt position's logits, so nothing is looked up;
- "evicted": the block's hash was cached and evicted (the pool's bounded log: step and request);
- "other tenant": the same tokens are cached under another tenant's salt (prefix_cache_scope="tenant");
- "other model": a previous engine of this kernel cached them with another model or revision;
- "differs": the first miss, against the nearest cached chain (the cached block under the same
  parent sharing the most leading tokens): the first prompt token that differs;
- "after miss": a block past the first miss with none of the causes above (a hit must continue
  an unbroken chain from the first block, so a block after a new one is new too).

Cost: once per request, only for the blocks past the last hit; another salt's chain is hashed
only when the pool holds blocks under another salt, and at most `MAX_CANDIDATES` siblings are
compared to find the nearest chain.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping

from .block_pool import hash_block

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .sequence import Sequence

HIT, DIFFERS, AFTER_MISS = "hit", "differs", "after miss"
EVICTED, OTHER_TENANT, OTHER_MODEL = "evicted", "other tenant", "other model"
PARTIAL, LAST_TOKEN, CACHING_OFF, PROMPT_LOGPROBS = "partial", "last token", "caching off", "prompt logprobs"
# Causes of a block some cache held: a turn with these recomputed work that existed.
REUSABLE = frozenset({EVICTED, OTHER_TENANT, OTHER_MODEL})
MAX_CANDIDATES = 512    # siblings compared to find the nearest cached chain
MAX_SALTS = 8           # other tenants' salts whose chains are hashed


@dataclass(frozen=True, slots=True)
class PrefixLedger:
    """What an engine had cached, for the engine that replaces it (another model or revision):
    the model identity and the chained hashes (they depend on tokens and salt only)."""

    identity: str
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockSpan:
    """Prompt blocks `first`..`last` (inclusive) that share one cause and its details."""

    first: int
    last: int
    cause: str
    step: int | None = None       # evicted: at which engine step
    by: str | None = None         # evicted: for whose allocation (a request id)
    block_id: int | None = None   # evicted: the block that held it; differs: the nearest cached block
    tenant: str | None = None     # other tenant: whose salt holds it (None: requests naming nobody)
    model: str | None = None      # other model: the model identity that cached it
    token: int | None = None      # differs: the first prompt token that differs

    @property
    def num_blocks(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class MissReport:
    """Per prompt block, hit or why not, as the request found the cache at admission."""

    request_id: str
    num_tokens: int
    block_size: int
    spans: tuple[BlockSpan, ...]
    snippet: str | None = None    # the text around `first_difference` (the engine decodes it)

    def causes(self) -> list[str]:
        """One cause per prompt block ("hit" for hits)."""
        return [s.cause for s in self.spans for _ in range(s.num_blocks)]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def num_hits(self) -> int:
        return sum(s.num_blocks for s in self.spans if s.cause == HIT)

    @property
    def num_reusable(self) -> int:
        """Blocks recomputed although some cache held them (evicted, another salt or model)."""
        return sum(s.num_blocks for s in self.spans if s.cause in REUSABLE)

    @property
    def first_difference(self) -> int | None:
        return next((s.token for s in self.spans if s.cause == DIFFERS), None)

    def line(self) -> str:
        """One line for a chat footer: the reusable blocks recomputed and the first cause."""
        first = next(s for s in self.spans if s.cause in REUSABLE)
        return (f"prefix cache: {self.num_reusable} blocks recomputed that a cache held "
                f"({_phrase(first, self)}); %pagedkv why {self.request_id}")

    def __str__(self) -> str:
        hits = self.num_hits * self.block_size
        head = (f"{self.request_id}: {self.num_hits} of {self.num_blocks} prompt blocks hit the prefix "
                f"cache ({hits} of {self.num_tokens} tokens, block size {self.block_size})")
        rest = [_phrase(s, self) for s in self.spans if s.cause != HIT]
        return head + (": " + "; ".join(rest) if rest else "") + "."


def _blocks(s: BlockSpan) -> str:
    return f"block {s.first}" if s.first == s.last else f"blocks {s.first}-{s.last}"


def _phrase(s: BlockSpan, report: MissReport) -> str:
    b = _blocks(s)
    if s.cause == DIFFERS:
        where = f" ({report.snippet!r})" if report.snippet else ""
        if s.block_id is None:
            return f"{b} starts a chain nothing cached continues (first new token {s.token}{where})"
        return f"{b} differs from the nearest cached chain at token {s.token}{where}"
    if s.cause == EVICTED:
        return f"{b} {'was' if s.num_blocks == 1 else 'were'} cached and evicted at step {s.step} for {s.by}"
    if s.cause == OTHER_TENANT:
        who = f"tenant {s.tenant!r}" if s.tenant is not None else "requests without a tenant"
        return f"{b} cached under {who}'s salt (prefix_cache_scope='tenant' keeps tenants apart)"
    if s.cause == OTHER_MODEL:
        return f"{b} cached by {s.model}, another model or revision (its KV does not fit this one)"
    if s.cause == PARTIAL:
        n = report.num_tokens - s.first * report.block_size
        return f"{b} partial ({n} of {report.block_size} tokens; only full blocks are cached)"
    return {AFTER_MISS: f"{b} after the first miss",
            LAST_TOKEN: f"{b} holds the last prompt token, always computed (hits stop one token short)",
            CACHING_OFF: f"{b} not looked up: prefix caching is off",
            PROMPT_LOGPROBS: f"{b} not looked up: prompt_logprobs needs every position's logits",
            }[s.cause]


def explain(pool: BlockPool, seq: Sequence, num_hits: int, foreign: Mapping[int, str]) -> MissReport:
    """The report for `seq` admitted with its first `num_hits` blocks hit (before it allocates)."""
    bs, n = pool.block_size, seq.num_tokens
    lookable = (n - 1) // bs     # blocks that may hit: the last token is never one
    per_block: list[BlockSpan] = []
    logprobs = getattr(seq.params, "prompt_logprobs", None) is not None and not seq.num_output_tokens
    others = None
    for i in range(-(-n // bs)):
        if i < num_hits:
            span = BlockSpan(i, i, HIT)
        elif not pool.enable_prefix_caching:
            span = BlockSpan(i, i, CACHING_OFF)
        elif (i + 1) * bs > n:
            span = BlockSpan(i, i, PARTIAL)
        elif i >= lookable:
            span = BlockSpan(i, i, LAST_TOKEN)
        elif logprobs:
            span = BlockSpan(i, i, PROMPT_LOGPROBS)
        else:
            if others is None:
                others = _other_salts(pool, seq, lookable)
            span = _missed(pool, seq, i, num_hits, foreign, others)
        per_block.append(span)
    return MissReport(seq.request_id, n, bs, _merge(per_block))


def _missed(pool: BlockPool, seq: Sequence, i: int, num_hits: int, foreign: Mapping[int, str],
            others: list[tuple[object, list[int]]]) -> BlockSpan:
    h = seq.hashes_upto(i + 1)[i]
    if h not in pool.cached and h in pool.evictions:
        e = pool.evictions[h]
        return BlockSpan(i, i, EVICTED, step=e.step, by=e.by, block_id=e.block_id)
    for salt, chain in others:
        block = pool.cached.get(chain[i])
        if block is not None and block.extra_key == salt and block.token_ids == tuple(_tokens(seq, i, pool.block_size)):
            return BlockSpan(i, i, OTHER_TENANT, tenant=salt[1] if isinstance(salt, tuple) else salt)
    if h in foreign:
        return BlockSpan(i, i, OTHER_MODEL, model=foreign[h])
    if i == num_hits:
        return _nearest(pool, seq, i)
    return BlockSpan(i, i, AFTER_MISS)


def _tokens(seq: Sequence, i: int, bs: int) -> list[int]:
    return seq.token_ids[i * bs:(i + 1) * bs]


def _other_salts(pool: BlockPool, seq: Sequence, num_blocks: int) -> list[tuple[object, list[int]]]:
    """The chain of `seq`'s blocks under each other salt the pool holds blocks with."""
    bs, chains = pool.block_size, []
    for salt in [s for s in pool.salts if s != seq.extra_key][:MAX_SALTS]:
        parent, chain = None, []
        for i in range(num_blocks):
            parent = hash_block(parent, _tokens(seq, i, bs), salt)
            chain.append(parent)
        chains.append((salt, chain))
    return chains


def _nearest(pool: BlockPool, seq: Sequence, i: int) -> BlockSpan:
    """The first miss against the cached blocks under the same parent: where the text departs."""
    bs = pool.block_size
    parent = seq.hashes_upto(i)[i - 1] if i else None
    tokens = _tokens(seq, i, bs)
    best, best_len = None, -1
    for k, h in enumerate(pool.children.get(parent, ())):
        if k >= MAX_CANDIDATES:
            break
        block = pool.cached[h]
        if block.extra_key != seq.extra_key:
            continue
        same = next((j for j, (a, b) in enumerate(zip(block.token_ids, tokens)) if a != b), bs)
        if same > best_len:
            best, best_len = block, same
    if best is None:
        return BlockSpan(i, i, DIFFERS, token=i * bs)
    return BlockSpan(i, i, DIFFERS, block_id=best.block_id, token=i * bs + best_len)


def _merge(spans: list[BlockSpan]) -> tuple[BlockSpan, ...]:
    """Neighbouring blocks with one cause and the same details become one span."""
    out: list[BlockSpan] = []
    for s in spans:
        if out and s.cause not in (DIFFERS, EVICTED) and replace(out[-1], first=s.first, last=s.last) == s:
            out[-1] = replace(out[-1], last=s.last)
        elif out and s.cause == EVICTED and out[-1].cause == EVICTED and (out[-1].step, out[-1].by) == (s.step, s.by):
            out[-1] = replace(out[-1], last=s.last, block_id=None)
        else:
            out.append(s)
    return tuple(out)
