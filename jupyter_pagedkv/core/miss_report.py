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

from dataclasses import dataclass
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
MAX_CANDIDATES = 64     # siblings compared to find the nearest cached chain
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
    block_id: int | None = None   # differs: the nearest cached block (None: nothing cached continues)
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
        first = next((s for s in self.spans if s.cause in REUSABLE), None)
        if first is None:
            return f"prefix cache: no block recomputed that a cache held; %pagedkv why {self.request_id}"
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
    """The report for `seq` admitted with its first `num_hits` blocks hit (before it allocates).
    Each block gets a key (a BlockSpan's fields after `last`); runs of equal keys become spans."""
    bs, n = pool.block_size, seq.num_tokens
    lookable = (n - 1) // bs     # blocks that may hit: the last token is never one
    logprobs = getattr(seq.params, "prompt_logprobs", None) is not None and not seq.num_output_tokens
    looked_up = pool.enable_prefix_caching and not logprobs
    hashes = seq.hashes_upto(lookable) if looked_up else []
    others = _other_salts(pool, seq, lookable) if looked_up and num_hits < lookable else []
    runs: list[list] = [[0, num_hits - 1, (HIT,)]] if num_hits else []
    for i in range(num_hits, -(-n // bs)):
        if not pool.enable_prefix_caching:
            key: tuple = (CACHING_OFF,)
        elif (i + 1) * bs > n:
            key = (PARTIAL,)
        elif i >= lookable:
            key = (LAST_TOKEN,)
        elif logprobs:
            key = (PROMPT_LOGPROBS,)
        else:
            key = _missed(pool, seq, hashes, i, num_hits, foreign, others)
        if runs and runs[-1][2] == key and key[0] != DIFFERS:
            runs[-1][1] = i
        else:
            runs.append([i, i, key])
    return MissReport(seq.request_id, n, bs, tuple(BlockSpan(first, last, *key) for first, last, key in runs))


def _missed(pool: BlockPool, seq: Sequence, hashes: list[int], i: int, num_hits: int,
            foreign: Mapping[int, str], others: list[tuple[object, list[int]]]) -> tuple:
    """The key of a looked-up block that missed: (cause, step, by, block_id, tenant, model, token)."""
    h = hashes[i]
    if h not in pool.cached and h in pool.evictions:
        e = pool.evictions[h]
        return (EVICTED, e.step, e.by)
    for salt, chain in others:
        block = pool.cached.get(chain[i])
        if block is not None and block.extra_key == salt and block.token_ids == tuple(_tokens(seq, i, pool.block_size)):
            return (OTHER_TENANT, None, None, None, salt[1] if isinstance(salt, tuple) else salt)
    if h in foreign:
        return (OTHER_MODEL, None, None, None, None, foreign[h])
    if i == num_hits:
        return _nearest(pool, seq, hashes[i - 1] if i else None, i)
    return (AFTER_MISS,)


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


def _nearest(pool: BlockPool, seq: Sequence, parent: int | None, i: int) -> tuple:
    """The first miss against the cached blocks under the same parent: where the text departs."""
    bs = pool.block_size
    tokens = _tokens(seq, i, bs)
    best, best_len = None, -1
    for k, h in enumerate(pool.children.get(parent, ())):
        if k >= MAX_CANDIDATES:
            break
        block = pool.cached[h]
        if block.extra_key != seq.extra_key:
            continue
        theirs, same = block.token_ids, 0
        while same < bs and theirs[same] == tokens[same]:
            same += 1
        if same > best_len:
            best, best_len = block, same
    if best is None:
        return (DIFFERS, None, None, None, None, None, i * bs)
    return (DIFFERS, None, None, best.block_id, None, None, i * bs + best_len)
