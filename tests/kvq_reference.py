"""The oracle for an engine with a quantized KV cache: transformers' own model, run on the engine's
schedule.

A quantized cache's numbers depend on the schedule: a prefill chunk of two or more tokens attends
its own keys and values as computed, and everything earlier as the cache holds it (quantized and
back); a one-token chunk (a decode step) reads all of its context, itself included, from the
cache (docs/design.md, "Quantized KV cache"). So the oracle replays the engine's own schedule
(`engine.trace`: every step's chunks as request, sample, start, length) through the Hugging Face
model with its own KV cache (`DynamicCache`, unquantized) and an attention that quantizes and
dequantizes, with the format's definition, every position before the chunk (the whole context for
a one-token chunk). Only the schedule comes from the engine; the numbers are transformers'. A
chunk that starts at 0 again (recompute) starts from an empty cache; a sample's first chunk takes
its parent's cache, a prompt's first chunk past 0 (a prefix-cache hit) the cache of the earlier
sequence whose tokens it shares.

The attention honours what each layer hands it: a sliding window (a key `window` or more
positions back is not seen, transformers' rule), the layer's scaling, and logit soft-capping
(transformers' eager form, as Gemma 2 writes it). A chunk that verifies k draft tokens (the
trace's `drafts`) is fed the oracle's own greedy tokens as drafts, found by running the chunk
again until they stop changing (each row sees only the rows before it, so k + 1 runs settle it):
every draft the engine may accept must be that token, and the rows after a rejected one are
thrown away by both. Its k + 1 tokens stay provisional until the sequence's next sampling chunk
says how long the engine's sequence is.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from jupyter_pagedkv.testing.models import attention
from jupyter_pagedkv.worker.kv_quant import dequantize, quantize


def _fake_quantized_past(kind: str):
    def forward(module, query, key, value, attention_mask, scaling=None, sliding_window=None,
                softcap=None, **kwargs):
        q_len, ctx = query.shape[2], key.shape[2]
        stored = ctx if q_len == 1 else ctx - q_len        # positions read back from the cache
        key, value = key.clone(), value.clone()            # [b, kv_heads, ctx, head_dim]
        key[:, :, :stored] = dequantize(*quantize(key[:, :, :stored], kind), key.dtype)
        value[:, :, :stored] = dequantize(*quantize(value[:, :, :stored], kind), value.dtype)
        # One unpadded sequence: causal, aligned to the end (the chunk's rows are the last positions;
        # an implementation registered under another name gets no mask built for it).
        rows = torch.arange(ctx - q_len, ctx, device=query.device).view(-1, 1)
        cols = torch.arange(ctx, device=query.device).view(1, -1)
        mask = cols <= rows
        if sliding_window is not None:
            mask &= cols > rows - sliding_window
        mask = mask.view(1, 1, q_len, ctx)
        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
        return eager_attention_forward(module, query, key, value, bias, scaling=scaling, softcap=softcap)
    return forward


for _kind in ("fp8_e4m3", "int8"):
    AttentionInterface.register(f"kvq_replay_{_kind}", _fake_quantized_past(_kind))


@dataclass
class _Stream:
    tokens: list[int]            # the prompt, then the oracle's own greedy tokens
    cache: DynamicCache
    known: int = 0               # how many of `tokens` the engine's sequence is known to hold

    @property
    def computed(self) -> int:
        return self.cache.get_seq_length()


class Oracle:
    """Replays schedules; keeps every sequence's state across calls, so a later request's
    prefix-cache hit finds the sequence that computed those blocks."""

    def __init__(self, model, kind: str) -> None:
        self.model, self.kind = model, kind
        self.streams: dict[tuple[str, int], _Stream] = {}

    @torch.inference_mode()
    def replay(self, trace, prompts: dict[str, list[int]]) -> dict[tuple[str, int], list[int]]:
        """Greedy tokens per (request id, sample index) of `prompts` (request id -> prompt) as the
        oracle computes them on `trace`'s schedule (after a last verifying chunk, every token of
        it: the engine may have kept fewer)."""
        with attention(self.model, f"kvq_replay_{self.kind}"):
            for record in trace:
                drafts = {(rid, index): k for rid, index, k in record.drafts}
                for rid, index, start, n, samples in record.chunks:
                    stream = self.streams.get((rid, index)) or self._first(rid, index, start, prompts[rid])
                    self.streams[(rid, index)] = stream
                    _crop(stream.cache, start)        # recomputed after preemption: from 0 again
                    assert stream.computed == start, (rid, index, start, stream.computed)
                    k = drafts.get((rid, index), 0)
                    if samples:                       # the engine's sequence: start + n - k tokens
                        assert stream.known <= start + n - k <= len(stream.tokens), (rid, index, start, n, k)
                        del stream.tokens[start + n - k:]
                        stream.known = start + n - k
                    self._run(stream, start, n, k, samples)
        return {key: s.tokens[len(prompts[key[0]]):] for key, s in self.streams.items() if key[0] in prompts}

    def _run(self, stream: _Stream, start: int, n: int, k: int, samples: bool) -> None:
        """One chunk of n tokens from `start`, the last k of them drafts; a sampling chunk appends
        its k + 1 greedy tokens."""
        fed = stream.tokens[start:start + n - k]
        drafts: list[int] = []
        for _ in range(k + 1):
            _crop(stream.cache, start)
            ids = torch.tensor([fed + (drafts or [0] * k)])
            logits = self.model(input_ids=ids, past_key_values=stream.cache, use_cache=True).logits
            greedy = logits[0, n - k - 1:].argmax(-1).tolist()
            if greedy[:k] == drafts:
                break
            drafts = greedy[:k]
        if samples:
            stream.tokens.extend(greedy)
        elif k:
            raise AssertionError("drafts in a chunk that does not sample")

    def _first(self, rid: str, index: int, start: int, prompt: list[int]) -> _Stream:
        """A stream's state before its first chunk: empty, its parent's (a sample forked after the
        prompt), or the prefix of an earlier stream holding the same tokens (a prefix-cache hit)."""
        if start == 0:
            return _Stream(list(prompt), DynamicCache())
        donors = [self.streams[(rid, 0)]] if index > 0 else [
            s for s in self.streams.values() if s.computed >= start and s.tokens[:start] == prompt[:start]]
        assert donors, f"no earlier sequence computed the first {start} tokens of {rid}"
        cache = copy.deepcopy(donors[0].cache)
        _crop(cache, start)
        # A sample holds the prompt and the first token sampled for all (even if it is recomputed
        # from below the prompt's end before its first chunk runs).
        return _Stream(list(donors[0].tokens[:len(prompt) + 1]) if index > 0 else list(prompt), cache)


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions (transformers' crop takes how many to drop, negated)."""
    if cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())
