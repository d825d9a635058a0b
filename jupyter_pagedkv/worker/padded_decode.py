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

import torch

from ..core.scheduler import ScheduledChunk
from .attention import PagedMetadata, additive_mask
from .kv_cache import KVCache

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to `max_num_seqs` (and `max_num_seqs` itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


class StaticBatch:
    """The static buffers of one bucket, and its captured graph once there is one."""

    def __init__(self, size: int, max_blocks: int, kv_cache: KVCache, backend: str, max_seq_len: int) -> None:
        dev = kv_cache.k.device
        self.size = size
        self.input_ids = torch.zeros(1, size, dtype=torch.long, device=dev)
        self.position_ids = torch.zeros(1, size, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(size, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=dev)
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
        """Copy this step's decode rows into the bucket's buffers; padding rows point at scratch."""
        batch = self._batch(size)
        bs, pad = self.kv_cache.block_size, size - len(chunks)
        scratch = self.kv_cache.scratch_block
        ids, positions, slots, lens = [], [], [], []
        widest = max((-(-(c.start + 1) // bs) for c in chunks), default=1)
        flat: list[int] = []
        for c in chunks:
            table = c.seq.block_table
            ids.append(c.seq.token_ids[c.start])
            positions.append(c.start)
            slots.append(table.slot(c.start))
            lens.append(c.start + 1)
            row = table.block_ids[:widest]
            flat.extend(row)
            flat.extend([scratch] * (widest - len(row)))
        flat.extend([scratch] * (pad * widest))
        tables = torch.tensor(flat, dtype=torch.int32).view(size, widest)  # host: copied below
        dev = batch.input_ids.device
        batch.input_ids[0].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)  # host: copied in
        batch.position_ids[0].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)  # host: copied in
        batch.slot_mapping.copy_(torch.tensor(slots + [self.scratch_slot] * pad), non_blocking=True)  # host: copied in
        batch.seq_lens.copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32), non_blocking=True)  # host: copied in
        # Columns beyond `widest` keep older entries: no sequence's length reaches them.
        batch.block_tables[:, :widest].copy_(tables.to(dev, non_blocking=True))
        if self.backend != "triton":
            # The torch path attends one padded batch: keys of the `widest` blocks, masked by length.
            meta = batch.meta
            meta.decode_block_tables = batch.block_tables[:, :widest].long()
            visible = (torch.arange(widest * bs, device=dev).view(1, -1) < batch.seq_lens.view(-1, 1).long())
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
        its graph when one is captured)."""
        self.num_steps += 1
        if self.capture:
            if batch.graph is None:
                self._capture(batch)
            batch.graph.replay()
            self.num_replays += 1
            logits = batch.logits
        else:
            logits = self._forward(batch)
        return logits[0, :n]

    def capture_all(self) -> int:
        """Capture every bucket's graph now (all rows padding), largest first so the smaller
        graphs reuse the memory pool; returns how many were captured."""
        before = self.num_captures
        if self.capture:
            for size in sorted(self.buckets, reverse=True):
                batch = self.fill([], size)
                if batch.graph is None:
                    self._capture(batch)
        return self.num_captures - before

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

    def release(self) -> None:
        self._batches.clear()
        self._pool = None
