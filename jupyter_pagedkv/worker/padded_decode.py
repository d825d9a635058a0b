"""PaddedDecode: decode-only steps in a few fixed shapes, replayable as CUDA graphs.

On a GPU a decode step of a small model is bound by launching hundreds of kernels from Python;
replaying a captured CUDA graph launches them all at once. A graph replays fixed shapes and fixed
addresses, so a decode-only step (every chunk one token) is padded to the next bucket size B and
its inputs are copied into static buffers: ids and positions `[1, B]`, slot mapping `[B]`, block
tables `[B, max_blocks]`, sequence lengths `[B]`. Padding rows are token 0 at position 0 with a
one-token context in a scratch block outside the pool: they write their K/V there, read only it,
and their logits are dropped. The block tables have the width of the longest possible sequence
(the Triton kernel reads only the blocks a sequence's length covers), and the metadata's
`max_seq_len` is the model's context, so nothing in the forward depends on this step's values on
the host: no host synchronisation, and the same kernels replay for any step of that bucket.

On CUDA with `capture=True` the first step of each bucket is captured (after a warm-up run) and
later steps replay it; elsewhere the padded inputs run eagerly (the CPU tests check that padded
decode is token-identical to unpadded decode).
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from ..core.scheduler import ScheduledChunk
from .paged_metadata import PagedMetadata, additive_mask
from .input_staging import InputStaging, layout
from .kv_cache import KVCache

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to `max_num_seqs` (and `max_num_seqs` itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


def static_fields(size: int, max_blocks: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The inputs of a bucket of `size` rows, in the order they are staged (input_staging.py)."""
    return [("input_ids", torch.int64, (1, size)), ("position_ids", torch.int64, (1, size)),
            ("slot_mapping", torch.int64, (size,)), ("seq_lens", torch.int32, (size,)),
            ("block_tables", torch.int32, (size, max_blocks))]


class StaticBatch:
    """The static buffers of one bucket (views of one staging buffer that never moves, uploaded in
    one copy a step), and its captured graph once there is one."""

    def __init__(self, size: int, max_blocks: int, kv_cache: KVCache, backend: str, max_seq_len: int) -> None:
        dev = kv_cache.k.device
        self.size = size
        self.fields = static_fields(size, max_blocks)
        self.staging = InputStaging(dev, capacity=layout(self.fields)[1])
        views = self.staging.views(self.fields)
        self.input_ids, self.position_ids = views["input_ids"], views["position_ids"]
        self.slot_mapping, self.seq_lens = views["slot_mapping"], views["seq_lens"]
        self.block_tables = views["block_tables"]
        self.meta = PagedMetadata(
            kv_cache=kv_cache, slot_mapping=self.slot_mapping,
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=dev),
            seq_lens=self.seq_lens, block_tables=self.block_tables, num_decode=size,
            max_seq_len=max_seq_len, backend=backend)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None     # the graph's output buffer


class PaddedDecode:
    def __init__(self, model, kv_cache: KVCache, backend: str, max_num_seqs: int, max_model_len: int,
                 capture: bool = False) -> None:
        if kv_cache.scratch_block is None:
            raise ValueError("padded decode needs a KV cache with a scratch block (KVCache(..., scratch=True))")
        if capture and kv_cache.k.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device: load on cuda, or leave cuda_graphs off")
        if capture and backend != "triton":
            raise ValueError("CUDA graphs need the Triton attention backend (the torch path reads "
                             "lengths on the host): use attention_backend='triton' or 'auto'")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.capture = capture
        self.buckets = bucket_sizes(max_num_seqs)
        bs = kv_cache.block_size
        self.max_blocks = -(-max_model_len // bs)
        self.max_model_len = max_model_len
        self.scratch_slot = kv_cache.scratch_block * bs
        self._batches: dict[int, StaticBatch] = {}
        self._pool = None                       # one memory pool shared by every captured graph
        self.num_steps = 0                      # padded steps run (eager or replayed)
        self.num_replays = 0
        self.num_captures = 0
        self.num_verified = 0                   # captured graphs whose replay matched the eager step
        self.status = "decode steps padded to buckets, eager" if not capture else ""

    @staticmethod
    def eligible(chunks: list[ScheduledChunk]) -> bool:
        """Decode-only: every chunk is one token that samples (drafts make a chunk wider)."""
        return bool(chunks) and all(c.num_tokens == 1 and c.num_logits == 1 and c.samples for c in chunks)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _batch(self, size: int) -> StaticBatch:
        batch = self._batches.get(size)
        if batch is None:
            batch = self._batches[size] = StaticBatch(size, self.max_blocks, self.kv_cache, self.backend,
                                                      self.max_model_len)
        return batch

    def fill(self, chunks: list[ScheduledChunk], size: int) -> StaticBatch:
        """Stage this step's decode rows into the bucket's buffers (one copy); padding rows point
        at the scratch block. Per row only the token and the table's ids are read in Python; the
        slots and lengths follow from the positions and tables as arrays."""
        bs, n = self.kv_cache.block_size, len(chunks)
        positions = np.zeros(size, dtype=np.int64)
        positions[:n] = [c.start for c in chunks]
        widest = int(positions[:n].max()) // bs + 1 if n else 1
        tables = np.full((size, widest), self.kv_cache.scratch_block, dtype=np.int32)
        ids = np.zeros(size, dtype=np.int64)
        tokens, held = [], []
        for i, c in enumerate(chunks):
            seq = c.seq
            tokens.append(seq.token_ids[c.start])
            row = seq.block_table.ids()[:widest]
            tables[i, :len(row)] = row
            held.append(len(row))
        ids[:n] = tokens
        at = positions[:n]
        column = at // bs                      # the block of each row's position
        if n and not (column < np.asarray(held)).all():   # else it would write the scratch block
            raise RuntimeError("a decode row's position lies past its block table: the scheduler did not grow it")
        slots = np.full(size, self.scratch_slot, dtype=np.int64)
        slots[:n] = tables[np.arange(n), column].astype(np.int64) * bs + at % bs
        lens = positions + 1            # padding rows: position 0, length 1
        return self._stage(size, ids, positions, slots, lens, tables)

    def probe(self, size: int) -> StaticBatch:
        """A bucket whose rows attend over contexts from one token to the longest the buffers
        hold, every block of them the scratch block: what a graph is checked on at capture, so
        that block tables, lengths and split-K are read as a long real step reads them. Every row
        writes the same token at the same position into the same scratch slot (one value)."""
        longest = self.max_blocks * self.kv_cache.block_size
        lens = [1 + (longest - 1) * i // max(1, size - 1) for i in range(size)]
        tables = np.full((size, self.max_blocks), self.kv_cache.scratch_block, dtype=np.int32)
        return self._stage(size, [0] * size, [0] * size, [self.scratch_slot] * size, lens, tables)

    def _stage(self, size: int, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
               lens: Sequence[int], tables: np.ndarray) -> StaticBatch:
        batch = self._batch(size)
        # Columns beyond the table's width keep older entries: no sequence's length reaches them.
        batch.staging.fill(batch.fields, {"input_ids": ids, "position_ids": positions, "slot_mapping": slots,
                                          "seq_lens": lens, "block_tables": tables})
        if self.backend != "triton":
            # The torch path attends one padded batch: keys of the `widest` blocks, masked by length.
            meta, dev, widest = batch.meta, batch.input_ids.device, tables.shape[1]
            meta.decode_block_tables = batch.block_tables[:, :widest].long()
            visible = (torch.arange(widest * self.kv_cache.block_size, device=dev).view(1, -1)
                       < batch.seq_lens.view(-1, 1).long())
            meta.decode_mask = visible.view(size, 1, 1, -1)
            meta.decode_bias = additive_mask(meta.decode_mask, self.kv_cache.spec.dtype)
        return batch

    def _forward(self, batch: StaticBatch) -> torch.Tensor:
        out = self.model(input_ids=batch.input_ids, position_ids=batch.position_ids, paged=batch.meta,
                         use_cache=False, logits_to_keep=0)
        return out.logits

    def prepare(self, chunks: list[ScheduledChunk]) -> StaticBatch | None:
        """The filled buffers of this step's bucket, or None when the step is not decode-only or
        has more rows than the largest bucket (it then runs unpadded)."""
        size = self.bucket(len(chunks)) if self.eligible(chunks) else None
        return None if size is None else self.fill(chunks, size)

    def run(self, batch: StaticBatch, n: int) -> torch.Tensor:
        """The logits of the first `n` rows, `[n, vocab]`, from a padded forward (replayed from
        its graph when one is captured and verified)."""
        self.num_steps += 1
        if self.capture and batch.graph is None:
            self._capture_verified(batch)
        if self.capture:
            batch.graph.replay()
            self.num_replays += 1
            logits = batch.logits
        else:
            logits = self._forward(batch)
        return logits[0, :n]

    def capture_all(self) -> int:
        """Capture every bucket's graph now (all rows padding), largest first so the smaller
        graphs reuse the memory pool, each verified against the eager step; returns how many
        were captured (0 once a failure has turned graphs off)."""
        before = self.num_captures
        for size in sorted(self.buckets, reverse=True):
            if not self.capture:
                break
            batch = self.probe(size)
            if batch.graph is None:
                self._capture_verified(batch)
        return self.num_captures - before if self.capture else 0

    def _capture_verified(self, batch: StaticBatch) -> None:
        """Capture the bucket, replay it once and compare its logits with the eager step's on the
        same inputs; on a capture error or a mismatch, log one line and run eagerly from now on."""
        try:
            eager = self._forward(batch).float().clone()
            self._capture(batch)
            batch.graph.replay()
            why = logits_mismatch(batch.logits.float(), eager, self.kv_cache.spec.dtype)
        except Exception as err:       # any capture failure: the step still runs, eagerly
            logger.debug("CUDA graph capture of %d rows failed", batch.size, exc_info=True)
            why = f"capture failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        if why is None:
            self.num_verified += 1
            return
        self.capture = False
        self.status = f"decode steps eager: the CUDA graph of {batch.size} rows {why}"
        logger.warning("CUDA graphs off: the graph of %d rows %s; decode steps run eagerly", batch.size, why)
        self.release()

    def _capture(self, batch: StaticBatch) -> None:
        """Warm up on a side stream (kernel compiles, allocator), then capture one forward."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            batch.logits = self._forward(batch)
        batch.graph = graph
        self.num_captures += 1
        logger.info("captured the decode step for %d rows as a CUDA graph", batch.size)

    def describe(self) -> str:
        """What `info()` says of decode steps: graphs on (and how many verified) or why not."""
        if self.capture:
            return f"decode steps as CUDA graphs ({self.num_verified} of {len(self.buckets)} buckets captured and verified)"
        return self.status

    def release(self) -> None:
        self._batches.clear()
        self._pool = None


def logits_mismatch(replayed: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when a replay's logits match the eager step's: within max(1e-3, 4 eps of the model's
    dtype) of the largest logit (the same kernels replayed give the same bits; a library that picks
    another algorithm under capture may move the last bits of a 16-bit value, a wrong buffer or
    address moves far more). Otherwise what differs, in a few words."""
    if replayed.shape != eager.shape:
        return f"replayed logits of shape {tuple(replayed.shape)}, not {tuple(eager.shape)}"
    if not bool(torch.isfinite(replayed).all()):
        return "replayed non-finite logits"
    diff = float((replayed - eager).abs().max())
    scale = max(1.0, float(eager.abs().max()))
    if diff > max(1e-3, 4 * torch.finfo(dtype).eps) * scale:
        return f"replayed logits {diff:.3g} away from the eager step's (largest {scale:.3g})"
    return None
