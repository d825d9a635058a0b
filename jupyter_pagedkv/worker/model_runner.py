"""ModelRunner: one scheduler step -> one flat forward pass -> logits at the sampling positions."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from ..core.scheduler import ScheduledChunk
from .attention import ATTN_IMPLEMENTATION
from .paged_metadata import PagedMetadata, PrefillChunk
from .input_staging import InputStaging
from .kv_cache import KVCache
from .lean_forward import LeanForward
from .packed_linear import PackedLinears, pack_linears, packed_gemms
from .padded_decode import PaddedDecode
from .plan import ExecutionPlan, Kernels
from .step_timing import ForwardClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """What a runner is given besides the model and its cache: the plan and what it loaded."""

    device: torch.device
    plan: ExecutionPlan
    kernels: Kernels = Kernels()
    packed: PackedLinears = field(default_factory=PackedLinears)   # from `prepare_model`
    padded: PaddedDecode | None = None      # decode-only steps in bucket shapes (plan.decode_steps)


def prepare_model(model, device: torch.device, pack: bool, hold_weights: bool = False) -> PackedLinears:
    """Give the model our attention and, with `pack`, its CPU GEMMs on weights packed once
    (packed_linear.py; with `hold_weights` the packed copies replace the plain ones). Done before
    the plan, which proves the lean loop under these very GEMMs."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    packed = pack_linears(model, hold_weights) if pack else PackedLinears()
    if packed.layers:
        _learn_packing(model, packed, device)
    return packed


def _learn_packing(model, packed: PackedLinears, device: torch.device) -> None:
    """Run one token through the model now, so that learning which layers share an input (and
    stacking their packed weights, ~0.3 s for the embedded model) is not paid by the first
    request's TTFT. Our attention falls back to plain SDPA without paged metadata."""
    try:
        with torch.inference_mode(), packed_gemms(packed):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    except Exception as err:    # a model that needs more than input_ids: it learns on its first step
        logger.info("packed GEMMs: the model did not run on one token (%s: %s); they are learned "
                    "on its first step instead", type(err).__name__, err)
        packed.learned = False


class ModelRunner:
    """Packs the step's chunks into `[1, num_tokens]` (decodes first), runs them the way the
    engine's ExecutionPlan says, and returns logits only for chunks that end at their sequence's
    last token."""

    def __init__(self, model, kv_cache: KVCache, config: RunnerConfig) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.plan = config.plan
        self.device = config.device
        self.backend = config.plan.backend.choice
        self.packed = config.packed
        self.padded = config.padded
        self.lean: LeanForward | None = config.kernels.lean
        # Given to every step, whichever loop runs it, so decode rows are attended by one code.
        self.decode_kernel = config.kernels.decode
        self.kv_write = config.kernels.kv_write
        self.prefill_kernel = config.kernels.prefill
        self.last_forward_s = 0.0      # host wall time of the last model call
        self.last_prepare_s = 0.0      # block copies, swaps and input building before it
        self.clock = ForwardClock(self.device)
        # The Triton path's inputs reach the device in one copy a step, into buffers that persist.
        self.staging = InputStaging(self.device) if self.backend == "triton" else None
        self.h2d_copies = 0            # host -> device copies of step inputs (counted on the Triton path)
        self.last_h2d_copies: int | None = None
        # The last step's prompt_logprobs rows: (chunk, logits [count, vocab]) per chunk that asked.
        self.last_prompt_logits: list[tuple[ScheduledChunk, torch.Tensor]] = []

    def warm_up(self, warmed: list[str]) -> int:
        """Compile every Triton kernel variant (CUDA; their roles go into `warmed`, once), then
        capture and verify every decode bucket's CUDA graph; returns how many verified graphs the
        runner holds (0 without graphs, or once a mismatch turned them off)."""
        with torch.inference_mode(), self.on_device():
            if self.backend == "triton" and self.device.type == "cuda" and not warmed:
                from .kernels_bridge import warm_up_model_kernels
                warmed[:] = warm_up_model_kernels(self.model, self.kv_cache, self.device)
            if self.padded is None or not self.padded.capture:
                return 0
            self.padded.capture_all()
            return self.padded.num_verified if self.padded.capture else 0

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], dict]:
        """Order chunks decode-first and build the model inputs plus the shared PagedMetadata."""
        step = StepLayout.of(chunks, self.kv_cache.block_size)
        if self.backend == "triton":
            return step.ordered, self._triton_inputs(step)
        return step.ordered, self._torch_inputs(step)

    def _triton_inputs(self, step: StepLayout) -> dict:
        """The Triton kernels read only the varlen description: every field is staged on the host
        and reaches the device in one copy (input_staging.py); no masks, no per-chunk tensors."""
        t, s = len(step.ids), len(step.seq_lens)
        width = max(len(b) for b in step.tables)
        views = self.staging.fill(
            [("input_ids", torch.int64, (1, t)), ("position_ids", torch.int64, (1, t)),
             ("slot_mapping", torch.int64, (t,)), ("logits_to_keep", torch.int64, (len(step.sample_rows),)),
             ("query_start_loc", torch.int32, (s + 1,)), ("seq_lens", torch.int32, (s,)),
             ("block_tables", torch.int32, (s, width))],
            {"input_ids": step.ids, "position_ids": step.positions, "slot_mapping": step.slots,
             "logits_to_keep": step.sample_rows, "query_start_loc": step.q_loc, "seq_lens": step.seq_lens,
             "block_tables": step.tables})
        self.h2d_copies += 1
        meta = PagedMetadata(
            kv_cache=self.kv_cache, slot_mapping=views["slot_mapping"], query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"], block_tables=views["block_tables"], num_decode=step.num_decode,
            max_seq_len=max(step.seq_lens), backend=self.backend)
        return {"input_ids": views["input_ids"], "position_ids": views["position_ids"],
                "logits_to_keep": views["logits_to_keep"], "paged": meta}

    def _torch_inputs(self, step: StepLayout) -> dict:
        """The torch path also reads pre-split decode rows (a padded batch with its masks) and one
        `PrefillChunk` per prefill; on the CPU these tensors are built where they are used."""
        bs, dev = self.kv_cache.block_size, self.device
        prefill_info: list[PrefillChunk] = []
        for i, (start, end) in enumerate(step.prefill_spans):
            ids_list = step.tables[step.num_decode + i][: -(-end // bs)]
            block_ids = torch.tensor(ids_list, dtype=torch.long, device=dev)
            prefill_info.append(PrefillChunk(step.q_loc[step.num_decode + i], end - start, end, block_ids,
                                             _first_if_consecutive(ids_list)))
        tables = step.tables
        max_blocks = max(len(t) for t in tables)
        padded = torch.zeros(len(tables), max_blocks, dtype=torch.int32)   # host: filled row by row
        for i, t in enumerate(tables):
            padded[i, :len(t)] = torch.tensor(t, dtype=torch.int32)       # host: a row of the above
        slot_mapping = torch.tensor(step.slots, dtype=torch.long)          # host: checked for -1 below
        meta = PagedMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=torch.tensor(step.q_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=dev),
            block_tables=padded.to(dev),
            num_decode=step.num_decode,
            prefills=prefill_info,
            max_seq_len=max(step.seq_lens),
            backend=self.backend,
            all_slots_valid=bool((slot_mapping >= 0).all()),
            prefill_kernel=self.prefill_kernel,
            decode_kernel=self.decode_kernel,
            kv_write=self.kv_write,
        )
        nd = step.num_decode
        if nd:
            dec_blocks = max(len(t) for t in tables[:nd])
            meta.decode_block_tables = padded[:nd, :dec_blocks].long().to(dev)
            # The padded decode's masks: built once per step, not per layer, where first asked
            # for (PagedMetadata.decode_masks).
        return {
            "input_ids": torch.tensor([step.ids], device=dev),
            "position_ids": torch.tensor([step.positions], device=dev),
            "logits_to_keep": torch.tensor(step.sample_rows, dtype=torch.long, device=dev),
            "paged": meta,
        }

    def on_device(self):
        """Make the model's GPU the current one (Triton launches and new streams go to the current
        device); nothing to do elsewhere."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def execute(self, chunks: list[ScheduledChunk], copies: list[tuple[int, int]],
                swap_out: list[tuple[int, int]] = (), swap_in: list[tuple[int, int]] = ()
                ) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run one step; returns the sampling chunks and their logits, in order: `num_logits` rows
        per chunk (one, or k + 1 for a chunk verifying k draft tokens)."""
        with self.on_device():
            return self._execute(chunks, copies, swap_out, swap_in)

    @torch.inference_mode()
    def _execute(self, chunks: list[ScheduledChunk], copies: list[tuple[int, int]],
                 swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
                 ) -> tuple[list[ScheduledChunk], torch.Tensor]:
        if self.model.config._attn_implementation != ATTN_IMPLEMENTATION:
            # Someone (a test, a peer benchmark) switched the model back to another attention.
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        t_prep = time.perf_counter()
        copies_before = self.h2d_copies
        # Order matters: swapped-out blocks are read before anything reuses them, then
        # copy-on-write, then swapped-in blocks land in their fresh blocks.
        self.kv_cache.swap_out(list(swap_out))
        if copies and self.backend == "triton":
            from .kernels_bridge import copy_blocks_triton
            copy_blocks_triton(self.kv_cache.k, self.kv_cache.v, copies)
            if self.kv_cache.k_scale is not None:      # a quantized block's scales go with its codes
                copy_blocks_triton(self.kv_cache.k_scale, self.kv_cache.v_scale, copies)
                self.h2d_copies += 1           # their pairs again
            self.h2d_copies += 1               # the (src, dst) pairs
        else:
            self.kv_cache.copy_blocks(copies)
        self.kv_cache.swap_in(list(swap_in))
        self.h2d_copies += bool(swap_in)       # the swapped blocks, staged as one tensor
        batch = self.padded.prepare(chunks) if self.padded is not None else None
        if batch is not None:
            ordered = chunks                    # decode-only: every chunk samples, in order
        else:
            ordered, inputs = self.prepare(chunks)
        t0 = time.perf_counter()
        self.last_prepare_s = t0 - t_prep
        if batch is not None:
            self.h2d_copies += 1               # the bucket's staged inputs (padded_decode.py)
        self.last_h2d_copies = self.h2d_copies - copies_before if self.backend == "triton" else None
        self.clock.start()
        with packed_gemms(self.packed):
            if batch is not None:
                logits = self.padded.run(batch, len(chunks))
            elif self.lean is not None and self.lean.usable():
                logits = self.lean(inputs["input_ids"], inputs["position_ids"], inputs["logits_to_keep"],
                                   inputs["paged"])
            else:
                logits = self.model(**inputs, use_cache=False).logits[0]
        logits = logits.float()
        self.clock.stop()
        self.last_forward_s = time.perf_counter() - t0
        logits, self.last_prompt_logits = split_prompt_rows(ordered, logits)
        return [c for c in ordered if c.samples], logits


@dataclass(slots=True)
class StepLayout:
    """One step's flat token row as plain host lists, decode chunks first: what both attention
    paths turn into tensors (the torch path builds its own; the Triton path stages them)."""

    ordered: list[ScheduledChunk]
    num_decode: int
    ids: list[int]
    positions: list[int]
    slots: list[int]
    q_loc: list[int]                       # [num_seqs + 1] query start of each chunk
    seq_lens: list[int]                    # context length after this step
    tables: list                           # each chunk's block ids (a decode's: its table's array view)
    prefill_spans: list[tuple[int, int]]   # (start, end) positions of each prefill chunk
    sample_rows: list[int]                 # rows whose logits are kept

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], block_size: int) -> StepLayout:
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        step = cls(decodes + prefills, len(decodes), [], [], [], [0], [], [], [], [])
        for c in decodes:
            table = c.seq.block_table
            step.ids.append(c.seq.token_ids[c.start])
            step.positions.append(c.start)
            step.slots.append(table.slot(c.start))
            step.q_loc.append(step.q_loc[-1] + 1)
            step.seq_lens.append(c.start + 1)
            step.tables.append(table.ids())
        for c in prefills:
            table = c.seq.block_table
            end = c.start + c.num_tokens
            step.ids.extend(c.seq.token_ids[c.start:end])
            step.positions.extend(range(c.start, end))
            blocks = table.block_ids
            step.slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(c.start, end))
            step.q_loc.append(step.q_loc[-1] + c.num_tokens)
            step.seq_lens.append(end)
            step.tables.append(blocks)
            step.prefill_spans.append((c.start, end))
        q = step.q_loc
        step.sample_rows = [r for i, c in enumerate(step.ordered) for r in _kept_rows(c, q[i], q[i + 1])]
        return step


def _kept_rows(c: ScheduledChunk, lo: int, hi: int) -> range | list[int]:
    """Rows of the flat token row whose logits a chunk needs: its prompt_logprobs positions, then
    its sampling rows (ascending, the order split_prompt_rows reads them back in)."""
    rows = range(hi - c.num_logits, hi) if c.samples else range(0)
    if c.prompt_logits is None:
        return rows
    first, count = c.prompt_logits
    return list(range(lo + first - c.start, lo + first - c.start + count)) + list(rows)


def split_prompt_rows(ordered: list[ScheduledChunk], logits: torch.Tensor
                      ) -> tuple[torch.Tensor, list[tuple[ScheduledChunk, torch.Tensor]]]:
    """The sampling rows' logits, and each prompt_logprobs chunk's own rows (nothing to do, and
    the same tensor back, when no chunk asked)."""
    if all(c.prompt_logits is None for c in ordered):
        return logits, []
    keep, prompt, row = [], [], 0
    for c in ordered:
        if c.prompt_logits is not None:
            count = c.prompt_logits[1]
            prompt.append((c, logits[row:row + count]))
            row += count
        if c.samples:
            keep.extend(range(row, row + c.num_logits))
            row += c.num_logits
    assert row == logits.shape[0], (row, logits.shape)
    return logits[keep], prompt


def _first_if_consecutive(block_ids: list[int]) -> int | None:
    """The first block when the blocks run b, b + 1, b + 2, ... (what a fresh pool hands a long
    prompt): attention then reads them in place instead of gathering them."""
    first = block_ids[0]
    return first if block_ids == list(range(first, first + len(block_ids))) else None
