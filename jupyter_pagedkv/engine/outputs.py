"""What the engine hands back for each request: outputs with metrics, and streamed increments."""
from __future__ import annotations

from dataclasses import dataclass
from ..core.stats import EngineStats


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_generated_tokens: int = 0
    # The same moments as engine step indices (deterministic: what a replay compares).
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """End-to-end time, arrival to finish."""
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass(frozen=True, slots=True)
class Logprob:
    """A token's log-probability under the model's raw distribution at one position (vLLM's shape)."""

    logprob: float
    rank: int | None = None            # 1 = the most likely token
    decoded_token: str | None = None   # the token alone as text (None without a tokenizer)


# Per position, token id -> Logprob: the chosen token first, then the top-k alternatives by rank.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated continuation (one of `n` samples)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    score: float | None = None   # beam search: the length-penalised score
    logprobs: list[PositionLogprobs] | None = None   # per generated token, when params.logprobs is set
    cumulative_logprob: float | None = None           # the chosen tokens' logprobs summed (same condition)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    tenant: str | None = None
    # Per prompt token when params.prompt_logprobs is set; the first is None (nothing predicts it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class StreamDelta:
    """An increment of one request's output, as `Engine.stream` yields it."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None
    # On the last delta of a request that failed (not one the caller aborted): what went wrong.
    error: BaseException | None = None


# -- read-only views for monitors, tables and front ends (see protocol.EngineClient) -----------
@dataclass(frozen=True)
class RequestRow:
    """One line of a request table: what `%pagedkv requests` shows for a live or recent request."""

    request_id: str
    state: str                    # "waiting", "running", "swapped", "done", "failed"
    prompt_tokens: int
    output_tokens: int
    blocks: int                   # KV blocks its first sample holds now
    cached_tokens: int | None     # prompt tokens found in the prefix cache (None: not admitted yet)
    ttft: float | None            # seconds
    finish_reason: str | None = None
    error: BaseException | None = None
    tenant: str | None = None

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is: model, device, dtype and the shape of its KV cache (for status lines
    and panel titles). Fields a server does not report are None."""

    name: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    summary: str                       # one line, as `%pagedkv load` / `status` print it
    bytes_per_block: int | None = None
    kv_bytes: int | None = None
    polled: bool = False               # no step events (a server): monitors poll it
    prefix_caching: bool | None = None
    max_model_len: int | None = None
    swap_blocks: int = 0               # host slots for swapped-out blocks (swap preemption)
    plan: tuple[str, ...] = ()         # the execution plan, one "role: choice (why)" per line (local engines)
    kv_dtype: str | None = None        # how K/V are stored: the model's dtype, "fp8_e4m3" or "int8"
    num_parameters: int | None = None  # the weights as the dense model counts them (tied ones once)
    weight_bytes: int | None = None    # what a forward reads of them: dtype-sized, or packed GGUF blocks

    @property
    def kv_phrase(self) -> str | None:
        """'KV int8, 11,880 bytes per token': what the monitor's title and `%pagedkv status`
        say of the cache (None for an engine that does not report it, a server)."""
        if self.kv_dtype is None or self.bytes_per_block is None:
            return None
        return f"KV {self.kv_dtype}, {self.bytes_per_block // self.block_size:,} bytes per token"


@dataclass
class Observation:
    """One consistent look at an engine for a monitor: the gauges, and which blocks changed.

    `touched` lists the blocks changed since the previous observation (None: unknown, so compare
    them all); `snapshot` covers the touched blocks, or every block when `touched` is None or a
    full scan was asked for."""

    num_steps: int
    stats: EngineStats
    touched: list[int] | None
    snapshot: dict | None
    waited_s: float = 0.0              # time spent waiting for the engine's lock (a step running)


@dataclass(frozen=True)
class QueueHead:
    """The request first in line for admission, and whether the pool's *layout* refuses it:
    enough blocks are free in total, but (contiguous baseline) no free run is long enough. What a
    fragmentation meter or caption needs, without reaching into the scheduler."""

    request_id: str
    blocks_needed: int                  # contiguous: its whole reservation; paged: blocks its tokens need
    free_blocks: int
    free_runs: tuple[int, ...] | None   # lengths of the free runs, in block order; None under paging

    @property
    def refused_by_layout(self) -> bool:
        """External fragmentation, now: never under paging, where any free block serves any table."""
        return (self.free_runs is not None and self.blocks_needed <= self.free_blocks
                and max(self.free_runs, default=0) < self.blocks_needed)
