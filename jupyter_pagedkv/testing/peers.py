"""transformers as a peer, three ways, for side-by-side benchmarks: one request at a time, padded
(static) batches, and its own continuous batching. Greedy, EOS ignored, each request gets exactly
its own `max_new_tokens`; the model runs on whatever device it is on, with SDPA attention."""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from .models import attention


def _device(model) -> torch.device:
    return next(model.parameters()).device


def hf_single(model, prompts: list[list[int]], limits: list[int], pad_id: int = 0) -> list[list[int]]:
    outs = []
    with attention(model, "sdpa"):
        for p, m in zip(prompts, limits):
            ids = torch.tensor([p], device=_device(model))
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                               eos_token_id=[], pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
            outs.append(g[0, len(p):].tolist())
    return outs


def hf_padded(model, prompts: list[list[int]], limits: list[int], batch: int | None = None,
              pad_id: int = 0) -> list[list[int]]:
    """Static batching: `batch` requests at a time (all when None), left-padded, each batch run
    until its longest request is done; only each request's own tokens are returned."""
    outs = []
    batch = batch or len(prompts)
    with attention(model, "sdpa"):
        for s in range(0, len(prompts), batch):
            group, lim = prompts[s:s + batch], limits[s:s + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group], device=_device(model))
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=_device(model))
            g = model.generate(ids, attention_mask=mask, max_new_tokens=max(lim), do_sample=False,
                               eos_token_id=[], pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
            outs.extend(g[i, width:width + m].tolist() for i, m in enumerate(lim))
    return outs


def hf_continuous(model, prompts: list[list[int]], limits: list[int], *, num_blocks: int,
                  max_batch_tokens: int, pad_id: int = 0, timeout_s: float = 600) -> list[list[int]]:
    """transformers' own continuous batching, sized explicitly (its automatic sizing takes a share
    of all memory); its other settings are its defaults on the model's device."""
    with hf_continuous_session(model, max(limits), num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                               pad_id=pad_id, timeout_s=timeout_s) as generate:
        return generate(prompts, limits)


@contextmanager
def hf_continuous_session(model, max_new_tokens: int, *, num_blocks: int, max_batch_tokens: int,
                          pad_id: int = 0, timeout_s: float = 600):
    """One started continuous-batching manager, yielded as `generate(prompts, limits)`: several runs
    share its start-up (cache allocation, worker thread), so a warm-up run before a timed one times
    the peer in steady state, as our engine is timed after its own warm-up."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=pad_id)
    # 5.17 calls the page size `block_size`, 5.24 `page_size` (and still accepts the old name).
    size_name = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb = ContinuousBatchingConfig(**{size_name: 16}, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_memory_percent=None)
    with attention(model, "sdpa"):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()

        def generate(prompts: list[list[int]], limits: list[int]) -> list[list[int]]:
            ids = [manager.add_request(p, max_new_tokens=m, eos_token_id=[]) for p, m in zip(prompts, limits)]
            wanted, results = set(ids), {}
            while len(results) < len(ids):
                r = manager.get_result(timeout=timeout_s)
                if r is None:
                    raise RuntimeError(f"transformers continuous batching returned no result in {timeout_s:.0f} s")
                if r.is_finished() and r.request_id in wanted:
                    results[r.request_id] = r.generated_tokens
            return [results[i] for i in ids]

        try:
            yield generate
        finally:
            manager.stop(block=True)
            if hasattr(model, "destroy_cached_continuous_batching_manager"):
                model.destroy_cached_continuous_batching_manager()
