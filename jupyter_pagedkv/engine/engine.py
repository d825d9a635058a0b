"""Engine: one model, one KV cache, one scheduler; requests in, streamed outputs out.

Every public call takes `self._lock`, and `step()` holds it for a whole iteration, so cells,
widgets and a background stepping thread can share one engine safely.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import queue
import re
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence as Seq

import torch

from ..decoding.beam_search import BeamSearch, BeamSearchOutput, advance
from ..core.block_pool import BlockPool
from ..core.block_table import BlockTable
from ..core.contiguous import ContiguousArena
from ..worker.kv_cache import KVCache, KVSpec
from ..worker.loader import load_model
from ..worker.model_runner import ModelRunner
from ..core.stats import EngineStats
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from ..worker.sampler import Sampler
from ..core.sampling_params import BeamSearchParams, SamplingParams
from ..core.scheduler import Scheduler, StepRecord
from ..core.sequence import Sequence, SequenceStatus
from ..worker.step_timing import StepTiming

Prompt = str | list[int]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)


def parse_size(size: str | int) -> int:
    """'512MiB', '1GiB', '1.5GB' or an int of bytes -> bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"cannot read size {size!r}: write it like '512MiB' or '2GiB'")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


@dataclass(eq=False)
class Request:
    """Engine-side state of one request: its sequences, metrics and any streaming listeners."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    done: threading.Event = field(default_factory=threading.Event)
    listeners: list[queue.SimpleQueue] = field(default_factory=list)
    sent_text: list[str] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    beam: BeamSearch | None = None      # set for beam search requests

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Engine:
    """A paged KV-cache engine over an unmodified Hugging Face causal LM."""

    def __init__(self, model, tokenizer=None, *, name: str | None = None, device: str = "auto",
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: str | int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", allocator: str = "paged",
                 max_model_len: int | None = None, attention_backend: str = "auto",
                 seed: int | None = None, swap_space: str | int | None = None,
                 speculative=None, num_speculative_tokens: int = 4,
                 pack_weights: bool | None = None) -> None:
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if allocator not in ("paged", "contiguous"):
            raise ValueError(f"allocator must be 'paged' or 'contiguous' (the baseline), got {allocator!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None) or 4096
        self.vocab_size = config.vocab_size
        self.spec = KVSpec.from_config(model.config, self.dtype)
        self.block_size = block_size
        if num_blocks is None:
            budget = parse_size(kv_cache_memory) if kv_cache_memory is not None else self._default_kv_bytes()
            num_blocks = budget // (self.spec.bytes_per_token * block_size)
        if num_blocks < 1:
            raise ValueError("the KV cache holds no block: give more kv_cache_memory or num_blocks")
        self.allocator = allocator
        # The contiguous baseline shares nothing, so it caches no prefix either.
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching and allocator == "paged")
        self.kv_cache = KVCache(self.spec, num_blocks, block_size, self.device)
        self.swap = None
        if preemption_mode == "swap":
            from ..core.swap_space import SwapSpace
            num_slots = parse_size(swap_space if swap_space is not None else "1GiB") // self.kv_cache.bytes_per_block
            if num_slots < 1:
                raise ValueError("swap_space holds no block: give at least one block's worth, e.g. '64MiB'")
            self.kv_cache.allocate_swap(num_slots)
            self.swap = SwapSpace(num_slots)
        self.preemption_mode = preemption_mode
        arena = ContiguousArena(self.pool) if allocator == "contiguous" else None
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, swap=self.swap,
                                   arena=arena, max_model_len=self.max_model_len)
        self.trace: list[StepRecord] | None = None   # set to [] to record every step's schedule
        self.step_timings: list[StepTiming] | None = None   # set to [] to time every step's phases
        from ..worker.kernels_bridge import resolve_backend
        backend = resolve_backend(self.device, None if attention_backend == "auto" else attention_backend)
        from ..worker.packed_linear import should_pack
        self.pack_weights = should_pack(self.device, self.dtype, pack_weights)
        self.runner = ModelRunner(model, self.kv_cache, self.device, backend, self.pack_weights)
        self.sampler = Sampler(seed)
        self.eos_token_ids = self._eos_ids()
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._requests: dict[str, Request] = {}
        self.finished_requests: deque[Request] = deque(maxlen=1000)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._token_times: deque[tuple[float, int]] = deque()
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.step_time_s = 0.0
        self.forward_time_s = 0.0
        self.seed = seed
        from ..decoding.drafters import NgramDrafter
        from ..decoding.speculative import Speculator
        self.speculator = Speculator(self.scheduler, {"ngram": NgramDrafter()}, None,
                                     num_speculative_tokens, self.max_model_len, self.sampler.generator)
        if speculative is not None:
            self.speculator.default = self.add_drafter(speculative)
        self._step_listeners: list[Callable[[], None]] = []
        self._monitor_feed = None

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def connect(url: str, api_key: str | None = None, model: str | None = None, **kwargs):
        """A client of a vLLM (OpenAI-compatible) server with this engine's surface; see remote.py."""
        from ..remote.client import RemoteEngine
        return RemoteEngine(url, api_key=api_key, model=model, **kwargs)

    @classmethod
    def from_pretrained(cls, model: str | None = None, device: str = "auto", dtype: str = "auto",
                        **kwargs) -> Engine:
        """Load a model (None: the embedded SmolLM2-135M-Instruct) and build an engine around it."""
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                           else ("cpu" if device == "auto" else device))
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        else:
            torch_dtype = getattr(torch, str(dtype).replace("torch.", ""), None)
            if not isinstance(torch_dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
        loaded = load_model(model, torch_dtype, dev)
        return cls(loaded.model, loaded.tokenizer, name=loaded.name, **kwargs)

    def add_drafter(self, speculative) -> str:
        """Register a drafter for speculative decoding and return its name: "ngram", a draft model
        id/path (loaded now), a loaded model, or any object with the `Drafter` methods."""
        from ..decoding.drafters import DraftModelDrafter
        if isinstance(speculative, str):
            if speculative in self.speculator.drafters:
                return speculative
            draft = load_model(speculative, self.dtype, self.device).model   # slow: not under the lock
            name = speculative
        elif hasattr(speculative, "propose"):
            with self._lock:
                self.speculator.drafters[speculative.name] = speculative
            return speculative.name
        elif isinstance(speculative, torch.nn.Module):
            draft = speculative
            name = getattr(draft.config, "_name_or_path", None) or f"draft-{id(draft):x}"
        else:
            raise ValueError(f"speculative must be 'ngram', a draft model id/path or a model, "
                             f"got {speculative!r}")
        drafter = DraftModelDrafter(draft, name, self.pool.num_blocks, self.block_size, self.device,
                                    self.runner.backend, self.vocab_size, self.seed, self.pack_weights)
        with self._lock:
            self.speculator.drafters.setdefault(name, drafter)
        return name

    def _default_kv_bytes(self) -> int:
        """CPU: a modest 1 GiB. CUDA: 90% of what is free after weights, minus an activation reserve."""
        if self.device.type != "cuda":
            return 1 << 30
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * 0.9) - (1 << 30)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return ids

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | BeamSearchParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    listener: queue.SimpleQueue | None = None) -> str:
        """Queue one request; returns its id. Bad input raises ValueError before anything is queued.

        `listener` receives the request's StreamDeltas from its first token on; attaching it here,
        under the lock, means a background step can never run before it is in place. With
        BeamSearchParams the request is a beam search (published once, when it finishes)."""
        params = params or SamplingParams()
        params.validate()
        if self.allocator == "contiguous" and (isinstance(params, BeamSearchParams) or params.n > 1):
            raise ValueError("the contiguous baseline cannot share a prompt between samples or beams: "
                             "use n=1 without beams, or allocator='paged'")
        if isinstance(getattr(params, "speculative", None), str):
            self.add_drafter(params.speculative)   # a draft model named per request loads once
        text, ids = self._tokenize(prompt)
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = self._beam_state(ids, params)
            params = beam.sampling_params
        self._check_fits(ids, params)
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            now = time.perf_counter()
            seq = Sequence(rid, list(ids), len(ids), params, BlockTable(self.pool), now, priority)
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed(params.seed)
            req = Request(rid, text, list(ids), params, [seq], RequestMetrics(now), beam=beam)
            if listener is not None:
                req.listeners.append(listener)
            self._requests[rid] = req
            self.scheduler.add(seq)
            self._work.notify_all()
        return rid

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("empty prompt: give some text or token ids")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            return prompt, self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not ids:
            raise ValueError("empty prompt: give some text or token ids")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return None, ids

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the model's context is "
                             f"{self.max_model_len}: shorten the prompt")
        need_tokens = min(len(ids) + params.max_tokens, self.max_model_len)
        need_blocks = -(-need_tokens // self.block_size)
        if need_blocks > self.pool.num_blocks:
            raise ValueError(
                f"one request needs {need_blocks} blocks ({len(ids)} prompt + {params.max_tokens} "
                f"new tokens) but the pool has {self.pool.num_blocks}: lower max_tokens or load "
                f"with more num_blocks / kv_cache_memory")

    def _beam_state(self, ids: list[int], params: BeamSearchParams) -> BeamSearch:
        beam = BeamSearch(params, len(ids), self.eos_token_ids, self.max_model_len)
        if beam.num_candidates > self.vocab_size:
            raise ValueError(f"beam_width {params.beam_width} keeps {beam.num_candidates} candidates per "
                             f"step but the vocabulary has {self.vocab_size}: use a smaller beam_width")
        need = beam.blocks_needed(len(ids), self.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"beam search with {params.beam_width} beams may need {need} blocks "
                             f"({len(ids)} prompt + {beam.max_new_tokens} new tokens per beam) but the "
                             f"pool has {self.pool.num_blocks}: lower beam_width or max_tokens, or load "
                             f"with more num_blocks / kv_cache_memory")
        return beam

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks at once; False if it was not live."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            now = time.perf_counter()
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            self._finish_request(req, now)
            return True

    def live_requests(self) -> list[Request]:
        """The unfinished requests, oldest first (a snapshot, for tables and monitors)."""
        with self._lock:
            return list(self._requests.values())

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    # -- one iteration --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs of requests that advanced."""
        with self._lock:
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            if sched.is_empty:
                if self.scheduler.has_work():
                    raise RuntimeError("the scheduler could not run any request: the pool is too small")
                return []
            record = sched.record() if self.trace is not None else None
            drafts: dict = {}
            self.runner.clock.enabled = self.step_timings is not None
            try:
                drafts = self.speculator.propose(sched)
                sampling, logits = self.runner.execute(sched.chunks, sched.copies,
                                                       sched.swap_out, sched.swap_in)
            except BaseException as err:
                self.speculator.discard(drafts)
                self._fail_all(err)
                raise
            t_launched = time.perf_counter()
            if self.step_timings is not None and self.runner.clock.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            now = time.perf_counter()
            self.speculator.observe(sched, drafts, self.runner.last_forward_s)
            verified = []
            if drafts:   # takes the drafts back out of token_ids before anything is hashed
                sampling, logits, verified = self.speculator.split(sampling, logits, drafts,
                                                                   self.sampler.generator)
            touched: dict[str, Request] = {}
            for c in sched.chunks:
                seq = c.seq
                seq.num_computed_tokens = c.start + c.num_tokens
                self.scheduler.cache_computed_blocks(seq)
                req = self._requests[seq.request_id]
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = t0
                touched[req.request_id] = req
            # A request with n > 1 forks its prefilled sequence at the first sample: the n
            # samples share the prompt's blocks and draw from the same logits row.
            rows, seqs, beam_rows = [], [], []
            for i, c in enumerate(sampling):
                if self._requests[c.seq.request_id].beam is not None:
                    beam_rows.append((c.seq, i))   # beams pick their tokens together, below
                    continue
                for seq in self._fork_samples(c.seq):
                    rows.append(i)
                    seqs.append(seq)
            try:
                tokens = self.sampler(logits[rows] if len(rows) != len(sampling) else logits, seqs)
            except BaseException as err:
                self._fail_all(err)
                raise
            for seq, token in zip(seqs, tokens):
                self._append_token(seq, token, now)
            for seq, accepted in verified:
                tokens.extend(accepted[:self._append_verified(seq, accepted, now)])
            num_beam_tokens = self._advance_beams(beam_rows, logits, now) if beam_rows else 0
            outputs = []
            for req in touched.values():
                if req.finished:
                    self._finish_request(req, now)
                outputs.append(self._output(req))
                self._publish(req)
            self.num_generated_tokens += len(tokens) + num_beam_tokens
            self._token_times.append((now, len(tokens) + num_beam_tokens))
            while self._token_times and now - self._token_times[0][0] > 10.0:
                self._token_times.popleft()
            self.num_steps += 1
            self.forward_time_s += self.runner.last_forward_s
            t1 = time.perf_counter()
            self.step_time_s += t1 - t0
            if record is not None:
                self.trace.append(dataclasses.replace(record, duration_s=t1 - t0))
            if self.step_timings is not None:
                runner = self.runner
                launched = t_launched - runner.last_forward_s - runner.last_prepare_s
                self.step_timings.append(StepTiming(
                    len(sched.chunks), sched.num_tokens, sum(c.num_tokens == 1 for c in sched.chunks),
                    launched - t0, runner.last_prepare_s, runner.last_forward_s,
                    runner.clock.device_seconds(), now - t_launched, t1 - now, t1 - t0))
            for listener in self._step_listeners:
                listener()
            return outputs

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """`[seq]`, or for the first sample of an n > 1 request, seq plus n - 1 forks of it."""
        req = self._requests[seq.request_id]
        n = seq.params.n
        if n == 1 or len(req.seqs) > 1 or seq.num_output_tokens:
            return [seq]
        for i in range(1, n):
            child = Sequence(seq.request_id, list(seq.token_ids), seq.prompt_len, seq.params,
                             seq.block_table.fork(), seq.arrival_time, seq.priority,
                             num_computed_tokens=seq.num_computed_tokens,
                             status=SequenceStatus.RUNNING, num_cached_tokens=seq.num_cached_tokens,
                             block_hashes=list(seq.block_hashes), extra_key=seq.extra_key)
            child.sample_index = i
            if seq.params.seed is not None:
                # Sample i of seed s is reproducible on its own, whatever else runs.
                child.generator = torch.Generator().manual_seed(hash((seq.params.seed, i)) & (2**63 - 1))
            self.scheduler.running.append(child)
            req.seqs.append(child)
        return list(req.seqs)

    def _advance_beams(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor, now: float) -> int:
        """Hand each beam request its beams' logits; a request selects once all its beams have them."""
        reqs: dict[str, Request] = {}
        for seq, row in rows:
            req = self._requests[seq.request_id]
            req.beam.pending[seq.seq_id] = logits[row].clone()
            reqs[req.request_id] = req
        num_tokens = 0
        for req in reqs.values():
            before = req.beam.num_generated
            req.seqs = advance(req.beam, req.seqs, self.scheduler)
            if req.beam.num_generated > before:
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.metrics.num_generated_tokens += 1
                num_tokens += len(req.seqs)
        return num_tokens

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        req = self._requests[seq.request_id]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.num_generated_tokens += 1
        params = seq.params
        reason: str | None = None
        if token in params.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif params.stop and self.tokenizer is not None:
            text = self._decode(seq.output_token_ids)
            for s in params.stop:
                at = text.find(s)
                if at >= 0:
                    reason, seq.stop_reason, seq.text = "stop", s, text[:at]
                    break
        if reason is None and (seq.num_output_tokens >= params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _append_verified(self, seq: Sequence, accepted: list[int], now: float) -> int:
        """Kept drafts plus the target's token (how many were appended before a stop): the kept
        drafts' KV stays, rejected slots roll back and emptied blocks return to the pool."""
        num_computed = seq.num_tokens + len(accepted) - 1
        self.speculator.roll_back(seq, num_computed)
        for i, token in enumerate(accepted):
            self._append_token(seq, token, now)
            if seq.is_finished:
                return i + 1
        seq.num_computed_tokens = num_computed
        self.scheduler.cache_computed_blocks(seq)
        return len(accepted)

    def _finish_request(self, req: Request, now: float) -> None:
        req.metrics.finish_time = now
        for seq in req.seqs:
            if seq.stop_reason is None or not isinstance(seq.stop_reason, str):
                seq.text = self._decode(seq.output_token_ids)
        if req.beam is not None:
            req.beam.finalize(self._decode, req.seqs)
        self._requests.pop(req.request_id, None)
        self.finished_requests.append(req)
        self._publish(req)
        req.done.set()

    def _fail_all(self, err: BaseException) -> None:
        """A broken step fails every live request and returns all their blocks."""
        now = time.perf_counter()
        for req in list(self._requests.values()):
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            req.error = err
            self._finish_request(req, now)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for i, seq in enumerate(req.seqs):
            text = seq.text if seq.is_finished else self._decode(seq.output_token_ids)
            completions.append(CompletionOutput(i, text, list(seq.output_token_ids),
                                                seq.finish_reason, seq.stop_reason))
        if req.beam is not None and req.finished:
            completions = [CompletionOutput(i, b.text, list(b.token_ids), b.finish_reason, score=b.score)
                           for i, b in enumerate(req.beam.sequences)]
        cached = req.seqs[0].num_cached_tokens or 0
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.finished, cached, req.metrics)

    def _publish(self, req: Request) -> None:
        """Send each listener the text and tokens added since the last update."""
        if not req.listeners:
            return
        seq = req.seqs[0]
        finished = req.finished
        tokens = seq.output_token_ids
        text = seq.text if finished else self._decode(tokens)
        if req.beam is not None:
            if not finished:
                return   # beams reorder every step: only the final hypotheses are published
            tokens, text = req.beam.sequences[0].token_ids, req.beam.sequences[0].text
        if not finished and text.endswith("\ufffd"):
            return   # an incomplete UTF-8 sequence: wait for the next token
        sent = "".join(req.sent_text)
        new_tokens = tokens[len(req.sent_tokens):]
        new_text = text[len(sent):] if text.startswith(sent) else text
        if not new_tokens and not new_text and not finished:
            return
        req.sent_text.append(new_text)
        req.sent_tokens.extend(new_tokens)
        delta = StreamDelta(req.request_id, new_text, new_tokens, finished,
                            seq.finish_reason, self._output(req) if finished else None)
        for q in req.listeners:
            q.put(delta)

    # -- high-level API -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion together; one RequestOutput per prompt, in order."""
        prompt_list = self._as_prompt_list(prompts)
        param_list = self._as_param_list(params, len(prompt_list))
        ids: list[str] = []
        try:
            for p, sp in zip(prompt_list, param_list):
                ids.append(self.add_request(p, sp))
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        return self._wait(ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search each prompt (run together); one BeamSearchOutput per prompt, best first."""
        params = params or BeamSearchParams()
        if not isinstance(params, BeamSearchParams):
            raise ValueError("beam_search takes BeamSearchParams(beam_width=..., max_tokens=...)")
        ids: list[str] = []
        try:
            for p in self._as_prompt_list(prompts):
                ids.append(self.add_request(p, params))
            with self._lock:
                reqs = [self._requests.get(rid) or next(r for r in self.finished_requests
                                                        if r.request_id == rid) for rid in ids]
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        self._wait(ids, use_tqdm)
        return [BeamSearchOutput(r.request_id, r.prompt, r.prompt_token_ids, list(r.beam.sequences))
                for r in reqs]

    def chat(self, messages, params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Chat-template one conversation (a list of {role, content}) or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in conversations], params, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use generate() with plain text")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield text increments as they are generated; closing the iterator aborts the request."""
        listener: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.add_request(prompt, params, request_id, listener=listener)
        with self._lock:
            req = self._requests.get(rid) or next(r for r in self.finished_requests if r.request_id == rid)
        try:
            while True:
                if not self.is_running:
                    while listener.empty() and not req.done.is_set():
                        self.step()
                    if listener.empty() and req.done.is_set():
                        if req.error is not None:
                            raise req.error
                        return
                delta = listener.get()
                yield delta
                if delta.finished:
                    if req.error is not None:
                        raise req.error
                    return
        finally:
            if not req.done.is_set():
                self.abort(rid)

    def _wait(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        with self._lock:
            reqs = [self._requests[rid] for rid in ids]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        try:
            reported = 0
            pending = list(reqs)
            while pending:
                if self.is_running:
                    pending[0].done.wait(timeout=0.1)
                else:
                    self.step()
                pending = [r for r in pending if not r.done.is_set()]
                if bar is not None and len(reqs) - len(pending) > reported:
                    bar.update(len(reqs) - len(pending) - reported)
                    reported = len(reqs) - len(pending)
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [self._output(r) for r in reqs]

    @staticmethod
    def _as_prompt_list(prompts) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        return prompts

    @staticmethod
    def _as_param_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
        return params

    # -- background stepping ---------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Step in a background thread whenever there is work (cells and widgets share the engine)."""
        with self._lock:
            if self.is_running:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="pagedkv-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.scheduler.has_work():
                    self._work.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:   # the failing requests carry the error; keep serving the others
                pass
            # Python locks are not fair: without a yield here the loop re-takes the lock before a
            # waiting thread (a monitor asking for stats) wakes, which then starves for seconds.
            time.sleep(0)

    # -- introspection -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        with self._lock:
            pool, bs = self.pool, self.block_size
            refs = [b.ref_count for b in pool.blocks]
            num_used = sum(1 for r in refs if r > 0)
            num_shared = sum(1 for r in refs if r > 1)
            num_cached = sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
            fill: dict[int, int] = {}
            for seq in self.scheduler.live:
                table = seq.block_table
                for i, block in enumerate(table.blocks):
                    n = min(bs, table.num_slots - i * bs)
                    if n > fill.get(block.block_id, 0):
                        fill[block.block_id] = n
            tokens_stored = sum(fill.values())
            spec = self.speculator.stats
            now = time.perf_counter()
            window = [(t, n) for t, n in self._token_times if now - t <= 10.0]
            tps = 0.0
            if len(window) >= 2:
                span = window[-1][0] - window[0][0]
                tps = sum(n for _, n in window[1:]) / span if span > 0 else 0.0
            return EngineStats(
                num_blocks=pool.num_blocks, block_size=bs,
                num_free=pool.num_blocks - num_used - num_cached, num_used=num_used,
                num_cached=num_cached, num_shared=num_shared,
                kv_cache_usage=num_used / pool.num_blocks,
                tokens_stored=tokens_stored, slots_allocated=num_used * bs,
                internal_waste=num_used * bs - tokens_stored,
                prefix_cache_queries=pool.prefix_cache_queries, prefix_cache_hits=pool.prefix_cache_hits,
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                num_preempted=sum(1 for s in self.scheduler.waiting if s.num_preemptions)
                + len(self.scheduler.swapped),
                num_preemptions=self.scheduler.num_preemptions,
                num_swapped_blocks=self.swap.num_used if self.swap is not None else 0,
                tokens_per_s=tps, num_generated_tokens=self.num_generated_tokens,
                num_finished=len(self.finished_requests),
                latency_percentiles=self._percentiles(), num_block_refs=sum(refs),
                spec_num_verifications=spec.num_verifications, spec_proposed_tokens=spec.num_proposed,
                spec_accepted_tokens=spec.num_accepted, spec_acceptance_rate=spec.acceptance_rate,
                spec_mean_accepted_length=spec.mean_accepted_length,
            )

    def _percentiles(self) -> dict[str, dict[str, float]]:
        result = {}
        for name in ("ttft", "tpot", "latency"):
            values = [getattr(r.metrics, name) for r in self.finished_requests if r.error is None]
            values = sorted(v for v in values if v is not None)
            if values:
                pick = lambda q: values[min(len(values) - 1, int(round(q * (len(values) - 1))))]
                result[name] = {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}
        return result

    def pool_snapshot(self, block_ids: Iterable[int] | None = None) -> dict:
        """Per-block state for monitors: 'free', 'cached', 'used' or 'shared', ref counts, owners.

        With `block_ids`, only those blocks, in that order (echoed as "block_ids"): a monitor's
        diff then costs O(changed blocks + live table entries) instead of O(num_blocks)."""
        with self._lock:
            blocks = self.pool.blocks if block_ids is None else [self.pool.blocks[i] for i in block_ids]
            wanted = None if block_ids is None else {b.block_id for b in blocks}
            owners: dict[int, list[str]] = {}
            for seq in self.scheduler.live:
                for block in seq.block_table.blocks:
                    if wanted is None or block.block_id in wanted:
                        owners.setdefault(block.block_id, []).append(seq.request_id)
            states = []
            for b in blocks:
                if b.ref_count > 1:
                    states.append("shared")
                elif b.ref_count == 1:
                    states.append("used")
                elif b.block_hash is not None:
                    states.append("cached")
                else:
                    states.append("free")
            spec = self.speculator.stats
            # Drafts live only inside a locked step, so no block is ever "speculative" here;
            # what the last step did with its drafts is reported instead.
            speculative = {"proposed": spec.num_proposed, "accepted": spec.num_accepted,
                           "acceptance_rate": spec.acceptance_rate,
                           "mean_accepted_length": spec.mean_accepted_length,
                           "last_step_draft_slots": spec.last_step_draft_slots,
                           "last_step_rolled_back_slots": spec.last_step_rolled_back,
                           "last_step_freed_blocks": list(spec.last_step_freed_blocks)}
            snap = {"num_blocks": self.pool.num_blocks, "block_size": self.block_size,
                    "states": states, "ref_counts": [b.ref_count for b in blocks],
                    "owners": owners, "speculative": speculative}
            if block_ids is not None:
                snap["block_ids"] = [b.block_id for b in blocks]
            return snap

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every step, in the stepping thread: monitors wake on it instead
        of polling. It runs under the engine lock, so it must be cheap (set an Event)."""
        with self._lock:
            self._step_listeners.append(listener)

    def remove_step_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._step_listeners:
                self._step_listeners.remove(listener)

    @property
    def monitor_feed(self):
        """The one MonitorFeed of this engine (created on first use), shared by every monitor."""
        with self._lock:
            if self._monitor_feed is None:
                from ..monitor.feed import MonitorFeed
                self._monitor_feed = MonitorFeed(self)
            return self._monitor_feed

    def monitor(self, **kwargs):
        """The live block-pool widget (anywidget); display it in a notebook cell."""
        from ..widgets import BlockPoolMonitor
        return BlockPoolMonitor(self, **kwargs)

    def check_invariants(self) -> None:
        """Assert every invariant of DESIGN.md; raises AssertionError naming the broken one."""
        with self._lock:
            expected: Counter[int] = Counter()
            bs = self.block_size
            live = self.scheduler.live
            for seq in live:
                table = seq.block_table
                expected.update(b.block_id for b in table.blocks)
                if self.scheduler.arena is None:
                    assert len(table.blocks) == -(-table.num_slots // bs), (
                        f"{seq.request_id}: {len(table.blocks)} blocks for {table.num_slots} slots "
                        f"(invariant 5: waste must stay under one block)")
                elif table.blocks:   # the baseline holds its whole reservation, in one run
                    want = -(-self.scheduler.reservation(seq) // bs)
                    ids = [b.block_id for b in table.blocks]
                    assert ids == list(range(ids[0], ids[0] + want)), (
                        f"{seq.request_id}: contiguous reservation {ids[0]}.. is not {want} adjacent blocks")
                slots = seq.swapped_num_slots if seq.status is SequenceStatus.SWAPPED else table.num_slots
                assert seq.num_computed_tokens <= slots, f"{seq.request_id}: computed tokens without slots"
                for i, block in enumerate(table.blocks):
                    if block.block_hash is not None:
                        assert list(block.token_ids) == seq.token_ids[i * bs:(i + 1) * bs], (
                            f"{seq.request_id}: block {block.block_id} content differs from its hash "
                            f"(invariant 3)")
            self.pool.check_invariants(expected)
            if self.scheduler.arena is not None:
                self.scheduler.arena.check_invariants()
            if self.swap is not None:
                held = [slot for seq in self.scheduler.swapped for slot in seq.swap_slots]
                assert len(held) == len(set(held)) == self.swap.num_used, (
                    f"swap space: {self.swap.num_used} slots in use but swapped sequences hold {len(held)}")
            for seq in self.scheduler.swapped:
                assert not seq.block_table.blocks and seq.swap_slots, (
                    f"{seq.request_id}: swapped but holds device blocks or no host slots")
            if not live:
                assert all(b.ref_count == 0 for b in self.pool.blocks), "blocks referenced with no request"

    def reset_prefix_cache(self) -> int:
        with self._lock:
            return self.pool.reset_cache()

    def shutdown(self) -> None:
        """Stop stepping, abort what is left and release the model and the KV memory."""
        self.stop()
        if self._monitor_feed is not None:
            self._monitor_feed.close()
        with self._lock:
            for rid in list(self._requests):
                self.abort(rid)
            self.kv_cache.release()
            self.runner.packed.release()
            for drafter in self.speculator.drafters.values():
                if hasattr(drafter, "release"):
                    drafter.release()
            self.runner.model = None
            self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __repr__(self) -> str:
        return (f"Engine({self.name!r}, device={self.device.type}, dtype={str(self.dtype).replace('torch.', '')}, "
                f"blocks={self.pool.num_blocks}x{self.block_size})")
