"""Long prompts: our TTFT against transformers' prefill, alternating pairs, per dtype and length.

Ours: one request, `max_tokens=1`, on a fresh engine (cold prefix cache) with the engine's
defaults, so its prompt is chunked exactly as a user's would be; only `max_model_len` is raised
where the prompt would not fit the model's context. TTFT runs from `add_request` to the step
that returns the first token. transformers: `generate(max_new_tokens=1)` with SDPA on its own
copy of the weights, which is its whole prefill plus one sampling.
"""
from __future__ import annotations

import gc
import time

import torch

from .throughput_report import long_entry

WARM_LEN = 64


def random_prompt(length: int, vocab: int, tokenizer, seed: int) -> list[int]:
    """`length` seeded token ids from the vocabulary, never a special or added token (those would
    start turns or end text in the middle of the prompt)."""
    allowed = torch.ones(vocab, dtype=torch.bool)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    allowed[[i for i in special if 0 <= i < vocab]] = False
    pool = allowed.nonzero().flatten()
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randint(len(pool), (length,), generator=g)].tolist()


def ours_ttft(model, tokenizer, prompt: list[int]) -> tuple[float, int]:
    """(seconds from add_request to the first token, that token) on a fresh engine."""
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine

    context = getattr(model.config, "max_position_embeddings", None) or 0
    engine = Engine(model, tokenizer, max_model_len=max(len(prompt) + 1, context))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    token = None
    with torch.inference_mode():
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params)
        while token is None:
            outs = engine.step()
            if not outs and not engine.has_unfinished_requests():
                raise RuntimeError("the engine finished the long prompt without a token")
            token = next((o.token_ids[0] for o in outs if o.request_id == rid and o.token_ids), None)
        seconds = time.perf_counter() - t0
    del engine
    gc.collect()          # the next engine allocates its KV cache afresh
    return seconds, token


def hf_prefill(model, prompt: list[int]) -> tuple[float, int]:
    """(seconds of generate(max_new_tokens=1), the token it chose)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                             pad_token_id=2, temperature=None, top_p=None, top_k=None)
        seconds = time.perf_counter() - t0
    return seconds, int(out[0, -1])


def run_long(ours_model, hf_model, tokenizer, lengths: list[int], rounds: int,
             dtype: str, seed: int = 0) -> dict[str, dict]:
    """{str(length): long_entry} for one dtype; prints every pair as it lands."""
    vocab = ours_model.config.vocab_size
    warm = random_prompt(WARM_LEN, vocab, tokenizer, seed)
    ours_ttft(ours_model, tokenizer, warm)        # untimed pair: one-off costs stay out
    hf_prefill(hf_model, warm)
    results = {}
    for length in lengths:
        prompt = random_prompt(length, vocab, tokenizer, seed + length)
        ours_s, hf_s, tok_ours, tok_hf = [], [], None, None
        for r in range(rounds):
            s, tok_ours = ours_ttft(ours_model, tokenizer, prompt)
            ours_s.append(s)
            s, tok_hf = hf_prefill(hf_model, prompt)
            hf_s.append(s)
            print(f"  {dtype} {length} tokens, pair {r + 1}: ours {ours_s[-1]:.2f} s, transformers "
                  f"{hf_s[-1]:.2f} s, ratio {ours_s[-1] / hf_s[-1]:.2f}x", flush=True)
        e = results[str(length)] = long_entry(ours_s, hf_s, tok_ours, tok_hf)
        print(f"  {dtype} {length} tokens: first token ours {tok_ours} {_text(tokenizer, tok_ours)}, "
              f"transformers {tok_hf} {_text(tokenizer, tok_hf)}: "
              f"{'same' if e['same_first_token'] else 'DIFFERENT'}", flush=True)
    return results


def _text(tokenizer, token: int | None) -> str:
    return "" if token is None or tokenizer is None else repr(tokenizer.decode([token]))
