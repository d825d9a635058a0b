"""Engine: one model, one KV cache, one scheduler; requests in, streamed outputs out.

Every public call takes `self._lock`, and `step()` holds it for a whole iteration, so cells,
widgets and a background stepping thread (`StepLoop`) can share one engine safely. What turns
tokens into text and deltas is the `OutputProcessor`; `generate` / `chat` / `stream` come from
`GenerationFront`, shared with the server client; the gauges from `core.stats`.
"""
from __future__ import annotations

import functools
import gc
import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Iterable

import torch

from ..config import EngineConfig
from ..core.block_pool import BlockPool
from ..core.contiguous import ContiguousKVCacheManager
from ..core.kv_cache_manager import PagedKVCacheManager
from ..core.miss_report import MissReport, PrefixLedger
from ..core.sampling_params import BeamSearchParams, SamplingParams
from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from ..core.stats import EngineCounters, EngineStats
from ..core.tenancy import check_spec
from ..decoding.beam_search import BeamSearchOutput
from ..decoding.grammar import Grammars
from ..decoding.speculative import Speculator
from ..worker.compat import check_servable
from ..worker.kv_cache import KVCache, KVSpec
from ..worker.model_runner import ModelRunner, RunnerConfig, prepare_model
from ..worker.packed_linear import should_pack
from ..worker.padded_decode import PaddedDecode
from ..worker.plan import PlanOptions, plan_execution
from ..worker.sampler import Sampler
from . import chat_template, extensions, intake, recording, setup
from .background import StepLoop
from .block_tables import SeqBlocks
from .frontend import GenerationFront
from .inspection import EngineInspection
from .stepping import Stepping
from .output_processor import OutputProcessor
from .outputs import EngineInfo, Observation, QueueHead, RequestMetrics, RequestOutput, RequestRow
from .request import Request

logger = logging.getLogger(__name__)


class Engine(GenerationFront):
    """A paged KV-cache engine over an unmodified Hugging Face causal LM.

    `Engine(model, tokenizer, config=None, **options)`: options are `EngineConfig` fields and
    override `config`'s (an unknown one is a TypeError); `dtype_reason` is why the model has its
    dtype (from_pretrained's "auto: ..." choice, which info() prints). Its parts are private; `Stepping` steps
    them and `EngineInspection` reads them, each given the very objects it uses."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *,
                 name: str | None = None, owns_model: bool = False,
                 dtype_reason: str = "the model's own dtype", **options) -> None:
        config = (config or EngineConfig()).replace(**options)
        self._config, self.model, self.tokenizer = config, model, tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.device, self.dtype = setup.served_as(model, config)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_model_len = config.max_model_len or getattr(text, "max_position_embeddings", None) or 4096
        self._vocab_size = text.vocab_size
        # The probe finds what the cache must hold (and refuses a model it cannot serve exactly).
        seen = check_servable(model, self.name)
        spec = KVSpec(text.num_hidden_layers, seen.num_kv_heads, seen.head_dim, self.dtype, config.kv_cache_dtype)
        num_blocks = setup.num_blocks(config, spec, self.device)
        paged = config.allocator == "paged"   # the contiguous baseline shares nothing: no prefix cache
        self._pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching and paged)
        # A model the engine loaded itself is held once, packed; one passed in keeps its plain
        # weights unless asked (its owner may still run it), and gets them back at shutdown.
        self._owns_model = owns_model
        self._pack_weights = should_pack(self.device, self.dtype, config.pack_weights)
        keep = config.keep_plain_weights if config.keep_plain_weights is not None else not owns_model
        self._hold_weights = self._pack_weights and not keep
        packed = prepare_model(model, self.device, self._pack_weights, self._hold_weights)
        try:
            plan, kernels = plan_execution(PlanOptions.of(config), model, self.device, self.dtype,
                                           seen.head_dim, packed, bool(seen.softcap), self.name)
        except BaseException:
            packed.release(restore=not owns_model)
            raise
        self._kv_cache = KVCache(spec, num_blocks, config.block_size, self.device, scratch=plan.pads_decode)
        self._swap = setup.swap_space(config.swap_space, self._kv_cache) if config.preemption_mode == "swap" else None
        kv = (PagedKVCacheManager(self._pool, self._swap) if paged
              else ContiguousKVCacheManager(self._pool, self.max_model_len, self._swap))
        self._scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                                    policy=config.scheduling_policy)
        padded = PaddedDecode(model, self._kv_cache, plan.backend.choice, config.max_num_seqs, self.max_model_len,
                              capture=plan.decode_steps.choice == "graphs") if plan.pads_decode else None
        self._runner = ModelRunner(model, self._kv_cache, RunnerConfig(self.device, plan, kernels, packed, padded))
        self._eos_token_ids = setup.eos_token_ids(model, tokenizer)
        self._sampler = Sampler(config.seed, self.device, self._eos_token_ids)
        self._grammars = Grammars(tokenizer, self._vocab_size, self._eos_token_ids)   # structured outputs
        self._outputs = OutputProcessor(tokenizer, self._eos_token_ids, self.max_model_len, self._scheduler)
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._requests: dict[str, Request] = {}
        self._finished: deque[Request] = deque(maxlen=1000)
        self._ids = itertools.count()
        self._counters = EngineCounters()
        from ..decoding.drafters import NgramDrafter
        self._speculator = Speculator(self._scheduler, {"ngram": NgramDrafter()}, None,
                                      config.num_speculative_tokens, self.max_model_len, self._sampler.generator)
        self._step_listeners: list[Callable[[], None]] = []
        self._shutdown_listeners: list[Callable[[], None]] = []
        self._warmed_kernels: list[str] = []        # Triton variants launched by warm_up (CUDA)
        self._stepping = Stepping(self._lock, self._scheduler, self._runner, self._speculator, self._sampler,
                                  self._outputs, self._counters, self._requests, self._finished,
                                  self._step_listeners, self.device)
        self._inspection = EngineInspection(
            self._lock, self._pool, self._scheduler, self._counters, self._swap, self._speculator, self._runner,
            self._kv_cache, self._requests, self._finished, self._step_listeners, self._shutdown_listeners,
            self._warmed_kernels, self.name, self.device, self.dtype, config.block_size, self.max_model_len,
            dtype_reason)
        if config.speculative is not None:
            self._speculator.default = self.add_drafter(config.speculative)
        self._advance = functools.partial(self._stepping.step, collect=False)   # no outputs built
        self._loop = StepLoop(self._advance, self._scheduler.has_work, self._work, self._stepping.loop_died)
        if self.device.type == "cuda" and plan.backend.choice == "triton":
            self.warm_up()      # every kernel compiled, every graph captured and verified, before a request

    @property
    def config(self) -> EngineConfig:
        """The options this engine was built with (read-only: a new engine takes new ones)."""
        return self._config

    block_size = property(lambda self: self._config.block_size, doc="tokens per KV block")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | None = None, device: str | None = None, dtype: str | None = None,
                        config: EngineConfig | None = None, **options) -> Engine:
        """Load a model (None: the embedded SmolLM2-135M-Instruct) and build an engine; given ones override `config`."""
        from ..worker.loader import load_model, resolve_device_dtype
        given = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        config = (config or EngineConfig()).replace(**given, **options)
        dev, choice = resolve_device_dtype(config.device, config.dtype, config.weights)
        loaded = load_model(model, choice.dtype, dev, revision=config.revision,
                            trust_remote_code=config.trust_remote_code, weights=config.weights)
        return cls(loaded.model, loaded.tokenizer, config, name=loaded.name, owns_model=True,
                   dtype_reason=choice.reason)

    @staticmethod
    def connect(url: str, api_key: str | None = None, model: str | None = None, **kwargs):
        """A client of a vLLM (OpenAI-compatible) server with this engine's interface."""
        return extensions.create("connect", url, api_key=api_key, model=model, **kwargs)

    def add_drafter(self, speculative) -> str:
        """Register a drafter for speculative decoding and return its name: "ngram", a draft model
        id/path (loaded now), a loaded model, or any object with the `Drafter` methods."""
        from ..decoding.drafters import DraftModelDrafter
        if isinstance(speculative, str) and speculative in self._speculator.drafters:
            return speculative
        if hasattr(speculative, "propose"):
            with self._lock:
                self._speculator.drafters[speculative.name] = speculative
            return speculative.name
        drafter = DraftModelDrafter.load(   # a model is loaded here, not under the lock
            speculative, self.dtype, self.device, self._hold_weights, num_blocks=self._pool.num_blocks,
            block_size=self.block_size, backend=self._runner.backend, target_vocab_size=self._vocab_size,
            seed=self._config.seed, pack_weights=self._pack_weights)
        with self._lock:
            return self._speculator.drafters.setdefault(drafter.name, drafter).name

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: intake.Prompt, params: SamplingParams | BeamSearchParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    listener: queue.SimpleQueue | None = None, tenant: str | None = None) -> str:
        """Queue one request; returns its id. Bad input raises ValueError before anything is queued.

        `tenant` names who sent it; under `prefix_cache_scope="tenant"` it salts the request's
        block hash chain, so its blocks are found only by requests of the same tenant.

        `listener` receives the request's StreamDeltas from its first token on; attaching it here,
        under the lock, means a background step can never run before it is in place. With
        BeamSearchParams the request is a beam search (published once, when it finishes)."""
        params = intake.check_params(params)
        intake.check_request_fields(request_id, priority)
        intake.check_parallel(params, self._scheduler.max_num_seqs)
        if self._config.allocator == "contiguous" and (isinstance(params, BeamSearchParams) or params.n > 1):
            raise ValueError("the contiguous baseline cannot share a prompt between samples or beams: "
                             "use n=1 without beams, or allocator='paged'")
        text, ids = intake.tokenize(self.tokenizer, prompt, self._vocab_size)
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = intake.beam_state(ids, params, self._eos_token_ids, self.max_model_len, self._vocab_size,
                                     self.block_size, self._pool.num_blocks)
            params = beam.sampling_params
        params = intake.within_context(ids, params, self.max_model_len)
        intake.check_fits(ids, params, self.max_model_len, self.block_size, self._pool.num_blocks)
        params = intake.resolve_bad_words(params, self.tokenizer)
        intake.check_token_ids(params, self._vocab_size)
        intake.check_logprobs(params, self._vocab_size)
        spec = getattr(params, "structured_outputs", None)   # its grammar compiles once per distinct spec
        grammar = self._grammars.start(spec) if spec is not None else None
        tenant = intake.check_tenant(tenant)
        if isinstance(params.speculative, str):   # last: only a request that passed every check loads one
            self.add_drafter(params.speculative)   # a draft model named per request loads once
        with self._lock:
            intake.check_cap(tenant, self._scheduler.tenancy.spec(tenant).max_blocks, ids, params, beam,
                             self.max_model_len, self.block_size)
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            now = time.perf_counter()
            seq = Sequence(rid, list(ids), len(ids), params, self._scheduler.kv.new_table(), now, priority,
                           extra_key=("tenant", tenant) if self._config.prefix_cache_scope == "tenant" else None,
                           tenant=tenant, width=beam.width if beam is not None else params.n)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
            seq.grammar = grammar
            req = Request(rid, text, list(ids), params, [seq], RequestMetrics(now), beam=beam, tenant=tenant)
            if listener is not None:
                req.listeners.append(listener)
            self._requests[rid] = req
            self._scheduler.add(seq)
            self._stepping.arrived(req)
            self._work.notify_all()
        return rid

    def set_tenant(self, name: str, weight: float = 1.0, max_blocks: int | None = None) -> None:
        """Give tenant `name` a weight in the fair share of the pool (scheduling_policy="fair") and
        an optional hard cap on the blocks it holds (either policy). A cap lower than what one of
        its live requests needs is refused, since that request could never finish."""
        check_spec(name, weight, max_blocks)
        with self._lock:
            intake.check_live_caps(name, max_blocks, self._requests.values(), self.max_model_len, self.block_size)
            self._scheduler.set_tenant(name, weight, max_blocks)
            self._work.notify_all()   # a raised cap may let waiting work in

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks at once; False if it was not live."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            self._stepping.abort(req)
            return True

    def live_requests(self) -> list[Request]:
        """The unfinished requests, oldest first (a snapshot, for tables and monitors)."""
        with self._lock:
            return list(self._requests.values())

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self._scheduler.has_work()

    # -- the front (generate / chat / stream come from GenerationFront) -----------------------------
    def beam_search(self, prompts, params: BeamSearchParams | None = None,
                    use_tqdm: bool = False, tenant: str | None = None) -> list[BeamSearchOutput]:
        """Beam search each prompt (run together); one BeamSearchOutput per prompt, best first."""
        from .frontend import prompt_list
        params = params or BeamSearchParams()
        if not isinstance(params, BeamSearchParams):
            raise ValueError("beam_search takes BeamSearchParams(beam_width=..., max_tokens=...)")
        prompts = prompt_list(prompts)
        ids = self._submit_all(prompts, [params] * len(prompts), tenant)
        reqs = [self._handle(rid) for rid in ids]
        self._wait(ids, use_tqdm)
        return [BeamSearchOutput(r.request_id, r.prompt, r.prompt_token_ids, list(r.beam.sequences))
                for r in reqs]

    has_chat_template = property(lambda self: chat_template.has_template(self.tokenizer))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_template.apply(self.tokenizer, messages)

    def chat_prompt(self, messages: list[dict], previous: list[int] | None = None) -> tuple[list[int], bool]:
        """The next prompt of a conversation, and whether it extends `previous` (prefix cache reuse)."""
        return chat_template.next_prompt(self.tokenizer, messages, previous)

    def _handle(self, rid: str) -> Request:
        with self._lock:
            return self._requests.get(rid) or next(r for r in reversed(self._finished) if r.request_id == rid)

    def _result(self, req: Request) -> RequestOutput:
        return self._outputs.output(req)

    def warm_up(self) -> int:
        """Compile every Triton variant this engine can launch (CUDA) and capture every decode
        bucket's CUDA graph, verified against the eager step; returns the verified graphs held."""
        with self._lock:
            return self._runner.warm_up(self._warmed_kernels)

    # -- background stepping ------------------------------------------------------------------------
    is_running = property(lambda self: self._loop.is_running, doc="whether the background loop steps")

    def start(self) -> None:
        """Step in a background thread whenever there is work (cells and widgets share the engine)."""
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def shutdown(self) -> None:
        """Stop stepping, abort what is left and release the model and the KV memory."""
        self.stop()
        for listener in self._shutdown_listeners:
            listener()
        with self._lock:
            for rid in list(self._requests):
                self.abort(rid)
            setup.release(self._kv_cache, self._runner, self._speculator.drafters.values(), self._owns_model)
            self.model = None
        gc.collect()
        from ..worker.host_memory import return_freed_memory
        return_freed_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- stepping and views, by the collaborators that own them ------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; the outputs of requests that advanced (Stepping)."""
        return self._stepping.step()

    trace = property(lambda self: self._stepping.trace, lambda self, v: setattr(self._stepping, "trace", v),
                     doc="None, or a list that records every step's schedule (StepRecord)")
    step_timings = property(lambda self: self._stepping.step_timings,
                            lambda self, v: setattr(self._stepping, "step_timings", v),
                            doc="None, or a list that times every step's phases (StepTiming)")

    def info(self) -> EngineInfo:
        return self._inspection.info()

    def stats(self) -> EngineStats:
        return self._inspection.stats()

    def pool_snapshot(self, block_ids: Iterable[int] | None = None) -> dict:
        return self._inspection.pool_snapshot(block_ids)

    def observe(self, full: bool = False) -> Observation:
        return self._inspection.observe(full)

    def request_rows(self, finished: int = 20) -> list[RequestRow]:
        return self._inspection.request_rows(finished)

    def queue_head(self) -> QueueHead | None:
        return self._inspection.queue_head()

    def block_tables(self) -> list[SeqBlocks]:
        """A copy of every live sequence's block table, taken under the lock (EngineClient)."""
        return self._inspection.block_tables()

    def check_invariants(self) -> None:
        """Assert the invariants of docs/design.md; an AssertionError names the broken one."""
        self._inspection.check_invariants()

    def reset_prefix_cache(self) -> int:
        return self._inspection.reset_prefix_cache()

    def record(self, path=None, keep_prompts: bool = False):
        """Record every request from now on; a context manager (engine/recording.py, engine/trace.py)."""
        return recording.start(self, path, keep_prompts)

    def why(self, request_id: str | None = None) -> MissReport:
        """Why each prompt block of a request (None: the newest) hit the prefix cache or not."""
        return self._inspection.why(request_id, self.tokenizer)

    def prefix_ledger(self, previous: PrefixLedger | None = None) -> PrefixLedger:
        """Model identity and cached chains; a `previous` engine's (other model or revision) feed `why`."""
        return self._inspection.prefix_ledger(self._config.revision, previous)

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        self._inspection.add_step_listener(listener)

    def remove_step_listener(self, listener: Callable[[], None]) -> None:
        self._inspection.remove_step_listener(listener)

    def add_shutdown_listener(self, listener: Callable[[], None]) -> None:
        self._inspection.add_shutdown_listener(listener)

    @property
    def monitor_feed(self):
        """The one MonitorFeed of this engine (created on first use), shared by every monitor."""
        return extensions.create("monitor_feed", self)

    def monitor(self, **kwargs):
        """The live block-pool widget (anywidget); display it in a notebook cell."""
        return extensions.create("monitor", self, **kwargs)

    # -- counters under their old names ---------------------------------------------------------------
    num_steps = property(lambda self: self._counters.num_steps)
    num_generated_tokens = property(lambda self: self._counters.num_generated_tokens)
    step_time_s = property(lambda self: self._counters.step_time_s)
    forward_time_s = property(lambda self: self._counters.forward_time_s)

    def __repr__(self) -> str:
        return (f"Engine({self.name!r}, device={self.device.type}, dtype={str(self.dtype).replace('torch.', '')}, "
                f"blocks={self._pool.num_blocks}x{self.block_size})")
