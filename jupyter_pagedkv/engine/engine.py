"""Engine: one model, one KV cache, one scheduler; requests in, streamed outputs out.

Every public call takes `self._lock`, and `step()` holds it for a whole iteration, so cells,
widgets and a background stepping thread (`StepLoop`) can share one engine safely. What turns
tokens into text and deltas is the `OutputProcessor`; `generate` / `chat` / `stream` come from
`GenerationFront`, shared with the server client; the gauges from `core.stats`.
"""
from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

import torch

from ..config import EngineConfig
from ..core.block_pool import BlockPool
from ..core.block_table import BlockTable
from ..core.contiguous import ContiguousKVCacheManager
from ..core.kv_cache_manager import PagedKVCacheManager
from ..core.sampling_params import BeamSearchParams, SamplingParams
from ..core.scheduler import Scheduler, StepRecord
from ..core.sequence import Sequence
from ..core.stats import EngineCounters
from ..core.tenancy import check_spec
from ..decoding.beam_search import BeamSearchOutput
from ..decoding.speculative import Speculator
from ..worker.compat import UnsupportedModelError, check_servable
from ..worker.kv_cache import KVCache, KVSpec
from ..worker.model_runner import ModelRunner
from ..worker.padded_decode import PaddedDecode
from ..worker.sampler import Sampler
from ..worker.step_timing import StepTiming
from . import extensions, intake, setup
from .background import StepLoop
from .frontend import GenerationFront, check_messages
from .inspection import EngineInspection
from .stepping import Stepping
from .output_processor import OutputProcessor
from .outputs import RequestMetrics, RequestOutput
from .request import Request

logger = logging.getLogger(__name__)


class Engine(Stepping, EngineInspection, GenerationFront):
    """A paged KV-cache engine over an unmodified Hugging Face causal LM.

    `Engine(model, tokenizer, config=None, **options)`: options are `EngineConfig` fields and
    override `config`'s (an unknown one is a TypeError)."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *,
                 name: str | None = None, owns_model: bool = False, **options) -> None:
        config = (config or EngineConfig()).replace(**options)
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.device = next(model.parameters()).device
        self.dtype_reason = "the model's own dtype"      # from_pretrained says how it chose
        self.dtype = next(model.parameters()).dtype
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_model_len = config.max_model_len or getattr(text, "max_position_embeddings", None) or 4096
        self.vocab_size = text.vocab_size
        # The probe finds what the cache must hold (and refuses a model it cannot serve exactly).
        seen = check_servable(model, self.name)
        self.spec = KVSpec(text.num_hidden_layers, seen.num_kv_heads, seen.head_dim, self.dtype)
        self.block_size = bs = config.block_size
        num_blocks = setup.num_blocks(config, self.spec, self.device)
        self.allocator, self.preemption_mode, self.seed = config.allocator, config.preemption_mode, config.seed
        self.prefix_cache_scope = config.prefix_cache_scope
        # The contiguous baseline shares nothing, so it caches no prefix either.
        self.pool = BlockPool(num_blocks, bs, config.enable_prefix_caching and self.allocator == "paged")
        from ..worker.kernels_bridge import resolve_backend
        backend = resolve_backend(self.device, None if config.attention_backend == "auto" else config.attention_backend)
        graphs = setup.use_cuda_graphs(config.cuda_graphs, self.device, backend)
        pad = config.pad_decode or graphs
        self.kv_cache = KVCache(self.spec, num_blocks, bs, self.device, scratch=pad)
        self.swap = setup.swap_space(config.swap_space, self.kv_cache) if self.preemption_mode == "swap" else None
        kv = (ContiguousKVCacheManager(self.pool, self.max_model_len, self.swap) if self.allocator == "contiguous"
              else PagedKVCacheManager(self.pool, self.swap))
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   policy=config.scheduling_policy)
        self.trace: list[StepRecord] | None = None            # [] records every step's schedule
        self.step_timings: list[StepTiming] | None = None     # [] times every step's phases
        from ..worker.packed_linear import should_pack
        if seen.softcap and backend == "triton":
            raise UnsupportedModelError(f"{self.name} soft-caps its attention logits, which the Triton kernels "
                                        f"do not: load it with attention_backend='torch' (--attention-backend torch)")
        self.pack_weights = should_pack(self.device, self.dtype, config.pack_weights)
        # A model the engine loaded itself is held once, packed; one passed in keeps its plain
        # weights unless asked (its owner may still run it), and gets them back at shutdown.
        self.owns_model = owns_model
        keep = config.keep_plain_weights if config.keep_plain_weights is not None else not owns_model
        self.hold_weights = self.pack_weights and not keep
        padded = PaddedDecode(model, self.kv_cache, backend, config.max_num_seqs, self.max_model_len,
                              capture=graphs) if pad else None
        self.runner = ModelRunner(model, self.kv_cache, self.device, backend, self.pack_weights, padded,
                                  self.hold_weights, config.step_loop, config.prefill_attention,
                                  config.decode_attention)
        self.eos_token_ids = setup.eos_token_ids(model, tokenizer)
        self.sampler = Sampler(config.seed, self.device, self.eos_token_ids)
        self._grammars = None      # structured outputs' compiler, built at the first such request
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler)
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._requests: dict[str, Request] = {}
        self.finished_requests: deque[Request] = deque(maxlen=1000)
        self._ids = itertools.count()
        self.counters = EngineCounters()
        from ..decoding.drafters import NgramDrafter
        self.speculator = Speculator(self.scheduler, {"ngram": NgramDrafter()}, None,
                                     config.num_speculative_tokens, self.max_model_len, self.sampler.generator)
        if config.speculative is not None:
            self.speculator.default = self.add_drafter(config.speculative)
        self._step_listeners: list[Callable[[], None]] = []
        self._shutdown_listeners: list[Callable[[], None]] = []
        self._loop = StepLoop(self.step, self.scheduler.has_work, self._work, self._loop_died)
        self._monitor_feed = None
        self.warmed_kernels: list[str] = []        # Triton variants launched by warm_up (CUDA)
        if self.device.type == "cuda" and backend == "triton":
            self.warm_up()      # every kernel compiled, every graph captured and verified, before a request

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | None = None, device: str = "auto", dtype: str = "auto",
                        config: EngineConfig | None = None, **options) -> Engine:
        """Load a model (None: the embedded SmolLM2-135M-Instruct) and build an engine around it."""
        from ..worker.loader import load_model, resolve_device_dtype
        config = (config or EngineConfig()).replace(device=device, dtype=dtype, **options)
        dev, choice = resolve_device_dtype(config.device, config.dtype)
        loaded = load_model(model, choice.dtype, dev, revision=config.revision,
                            trust_remote_code=config.trust_remote_code, weights=config.weights)
        engine = cls(loaded.model, loaded.tokenizer, config, name=loaded.name, owns_model=True)
        engine.dtype_reason = choice.reason
        return engine

    @staticmethod
    def connect(url: str, api_key: str | None = None, model: str | None = None, **kwargs):
        """A client of a vLLM (OpenAI-compatible) server with this engine's interface."""
        return extensions.create("connect", url, api_key=api_key, model=model, **kwargs)

    def add_drafter(self, speculative) -> str:
        """Register a drafter for speculative decoding and return its name: "ngram", a draft model
        id/path (loaded now), a loaded model, or any object with the `Drafter` methods."""
        from ..decoding.drafters import DraftModelDrafter
        if isinstance(speculative, str) and speculative in self.speculator.drafters:
            return speculative
        if hasattr(speculative, "propose"):
            with self._lock:
                self.speculator.drafters[speculative.name] = speculative
            return speculative.name
        if isinstance(speculative, str):
            from ..worker.loader import load_model
            draft, name = load_model(speculative, self.dtype, self.device).model, speculative   # not under the lock
            owned = True
        elif isinstance(speculative, torch.nn.Module):
            draft, owned = speculative, False
            name = getattr(draft.config, "_name_or_path", None) or f"draft-{id(draft):x}"
        else:
            raise ValueError(f"speculative must be 'ngram', a draft model id/path or a model, got {speculative!r}")
        drafter = DraftModelDrafter(draft, name, self.pool.num_blocks, self.block_size, self.device,
                                    self.runner.backend, self.vocab_size, self.seed, self.pack_weights,
                                    owns_model=owned, hold_weights=self.hold_weights or owned)
        with self._lock:
            self.speculator.drafters.setdefault(name, drafter)
        return name

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
        intake.check_parallel(params, self.scheduler.max_num_seqs)
        if self.allocator == "contiguous" and (isinstance(params, BeamSearchParams) or params.n > 1):
            raise ValueError("the contiguous baseline cannot share a prompt between samples or beams: "
                             "use n=1 without beams, or allocator='paged'")
        text, ids = intake.tokenize(self.tokenizer, prompt, self.vocab_size)
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = intake.beam_state(ids, params, self.eos_token_ids, self.max_model_len, self.vocab_size,
                                     self.block_size, self.pool.num_blocks)
            params = beam.sampling_params
        params = intake.within_context(ids, params, self.max_model_len)
        intake.check_fits(ids, params, self.max_model_len, self.block_size, self.pool.num_blocks)
        params = intake.resolve_bad_words(params, self.tokenizer)
        intake.check_token_ids(params, self.vocab_size)
        intake.check_logprobs(params, self.vocab_size)
        grammar = self._grammar_for(params)
        tenant = intake.check_tenant(tenant)
        if isinstance(params.speculative, str):   # last: only a request that passed every check loads one
            self.add_drafter(params.speculative)   # a draft model named per request loads once
        with self._lock:
            intake.check_cap(tenant, self.scheduler.tenancy.spec(tenant).max_blocks, ids, params, beam,
                             self.max_model_len, self.block_size)
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            now = time.perf_counter()
            seq = Sequence(rid, list(ids), len(ids), params, BlockTable(self.pool), now, priority,
                           extra_key=("tenant", tenant) if self.prefix_cache_scope == "tenant" else None,
                           tenant=tenant)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
            seq.grammar = grammar
            req = Request(rid, text, list(ids), params, [seq], RequestMetrics(now), beam=beam, tenant=tenant)
            if listener is not None:
                req.listeners.append(listener)
            self._requests[rid] = req
            self.scheduler.add(seq)
            self._work.notify_all()
        return rid

    def _grammar_for(self, params: SamplingParams):
        """The first sequence's grammar matcher, or None without structured_outputs. Each distinct
        spec compiles once (`decoding/grammar.Grammars`, built at the first such request)."""
        spec = getattr(params, "structured_outputs", None)
        if spec is None:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need the model's tokenizer: build the engine with one")
            from ..decoding.grammar import Grammars
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars.start(spec)

    def set_tenant(self, name: str, weight: float = 1.0, max_blocks: int | None = None) -> None:
        """Give tenant `name` a weight in the fair share of the pool (scheduling_policy="fair") and
        an optional hard cap on the blocks it holds (either policy). A cap lower than what one of
        its live requests needs is refused, since that request could never finish."""
        check_spec(name, weight, max_blocks)
        with self._lock:
            if max_blocks is not None:
                for req in self._requests.values():
                    if req.tenant == name and not req.finished:
                        intake.check_cap(name, max_blocks, req.prompt_token_ids, req.params, req.beam,
                                         self.max_model_len, self.block_size, req.request_id)
            self.scheduler.set_tenant(name, weight, max_blocks)
            self._work.notify_all()   # a raised cap may let waiting work in

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks at once; False if it was not live."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            self._finish_request(req, time.perf_counter())
            return True

    def live_requests(self) -> list[Request]:
        """The unfinished requests, oldest first (a snapshot, for tables and monitors)."""
        with self._lock:
            return list(self._requests.values())

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    def _finish_request(self, req: Request, now: float) -> None:
        self._requests.pop(req.request_id, None)
        self.finished_requests.append(req)
        self.counters.record_finish(req.tenant)
        self.outputs.finish(req, now)

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

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        check_messages(messages)
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template: use generate() with plain text")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def chat_prompt(self, messages: list[dict], previous: list[int] | None = None) -> tuple[list[int], bool]:
        """The next prompt of a conversation, and whether it extends `previous` (the tokens the model
        saw last turn, reply included), so that last turn's blocks hit the prefix cache; when the
        template rewrites earlier turns, the conversation is templated afresh."""
        if previous:
            tok = self.tokenizer
            full = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            kept = tok.decode(previous, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if full.startswith(kept):
                return list(previous) + list(tok(full[len(kept):], add_special_tokens=False).input_ids), True
        return self.apply_chat_template(messages), False

    def _handle(self, rid: str) -> Request:
        with self._lock:
            return self._requests.get(rid) or next(r for r in reversed(self.finished_requests)
                                                   if r.request_id == rid)

    def _result(self, req: Request) -> RequestOutput:
        return self.outputs.output(req)

    def warm_up(self) -> int:
        """Compile every Triton kernel variant this engine can launch (CUDA), then capture every
        decode bucket's CUDA graph (graphs on), each verified against the eager step, so that no
        request pays for a compile or a capture; returns how many verified graphs the engine holds
        (0 without graphs, or once a mismatch turned them off), however many calls captured them."""
        with self._lock, torch.inference_mode(), self.runner.on_device():
            if self.runner.backend == "triton" and self.device.type == "cuda" and not self.warmed_kernels:
                self.warmed_kernels = self._warm_kernels()
            padded = self.runner.padded
            if padded is None or not padded.capture:
                return 0
            padded.capture_all()
            return padded.num_verified if padded.capture else 0

    def _warm_kernels(self) -> list[str]:
        """Every variant, for each window the model's layers use (None: unwindowed), on dummy data;
        then copy_blocks once on the real cache, whose layer stride alone may need 64 bits."""
        from ..worker.kernels_bridge import copy_blocks_triton, warm_up_kernels
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        # Layers pass their window as an attribute (Qwen2, Gemma) or from the config (Mistral).
        windows = {getattr(m, "sliding_window", None) for m in self.model.modules() if hasattr(m, "layer_idx")}
        if getattr(text, "use_sliding_window", True) is not False:
            windows.add(getattr(text, "sliding_window", None))
        windows = {w if isinstance(w, int) and w > 0 else None for w in windows} | {None}
        roles = [role for w in sorted(windows, key=lambda w: w or 0)
                 for role in warm_up_kernels(self.spec, text.num_attention_heads, self.block_size, w, self.device)]
        copy_blocks_triton(self.kv_cache.k, self.kv_cache.v, [(0, 0)])    # block 0 onto itself: no change
        return roles + ["copy_blocks on the cache"]

    # -- background stepping ------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._loop.is_running

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
            self.kv_cache.release()
            self.runner.packed.release(restore=not self.owns_model)
            if self.runner.padded is not None:
                self.runner.padded.release()
            for drafter in self.speculator.drafters.values():
                if hasattr(drafter, "release"):
                    drafter.release()
            self.runner.model = None
            self.model = None
        gc.collect()
        from ..worker.host_memory import return_freed_memory
        return_freed_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- counters under their old names ---------------------------------------------------------------
    num_steps = property(lambda self: self.counters.num_steps)
    num_generated_tokens = property(lambda self: self.counters.num_generated_tokens)
    step_time_s = property(lambda self: self.counters.step_time_s)
    forward_time_s = property(lambda self: self.counters.forward_time_s)

    def __repr__(self) -> str:
        return (f"Engine({self.name!r}, device={self.device.type}, dtype={str(self.dtype).replace('torch.', '')}, "
                f"blocks={self.pool.num_blocks}x{self.block_size})")
