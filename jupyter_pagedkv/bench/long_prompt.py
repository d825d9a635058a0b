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


NEW_TOKENS = 11          # the follow-up over the cached prompt, and the lone prompt it is set against


def _first_token(engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds from add_request to the first token, that token)."""
    from ..core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    token = None
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while token is None:
        outs = engine.step()
        if not outs and not engine.has_unfinished_requests():
            raise RuntimeError("the engine finished a prompt without a token")
        token = next((o.token_ids[0] for o in outs if o.request_id == rid and o.token_ids), None)
    return time.perf_counter() - t0, token


def ours_ttft(model, tokenizer, prompt: list[int], follow_up: list[int]) -> tuple[float, int, float, float]:
    """On a fresh engine: (TTFT of `prompt`, its token, TTFT of `prompt + follow_up` over the
    prompt's cached blocks, TTFT of `follow_up` alone). The last two show whether a prefill over a
    cached prefix costs in proportion to its new tokens."""
    from ..engine.engine import Engine

    context = getattr(model.config, "max_position_embeddings", None) or 0
    engine = Engine(model, tokenizer, max_model_len=max(len(prompt) + len(follow_up) + 1, context))
    with torch.inference_mode():
        seconds, token = _first_token(engine, prompt)
        cached, _ = _first_token(engine, prompt + follow_up)
        lone, _ = _first_token(engine, follow_up)
    del engine
    gc.collect()          # the next engine allocates its KV cache afresh
    return seconds, token, cached, lone


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
    follow_up = random_prompt(NEW_TOKENS, vocab, tokenizer, seed + 1)
    ours_ttft(ours_model, tokenizer, warm, follow_up)        # untimed pair: one-off costs stay out
    hf_prefill(hf_model, warm)
    results = {}
    for length in lengths:
        prompt = random_prompt(length, vocab, tokenizer, seed + length)
        ours_s, hf_s, cached_s, lone_s, tok_ours, tok_hf = [], [], [], [], None, None
        for r in range(rounds):
            s, tok_ours, cached, lone = ours_ttft(ours_model, tokenizer, prompt, follow_up)
            ours_s.append(s)
            cached_s.append(cached)
            lone_s.append(lone)
            s, tok_hf = hf_prefill(hf_model, prompt)
            hf_s.append(s)
            print(f"  {dtype} {length} tokens, pair {r + 1}: ours {ours_s[-1]:.2f} s, transformers "
                  f"{hf_s[-1]:.2f} s, ratio {ours_s[-1] / hf_s[-1]:.2f}x; +{NEW_TOKENS} tokens over the "
                  f"cached prompt {cached * 1e3:.0f} ms, {NEW_TOKENS} tokens alone {lone * 1e3:.0f} ms", flush=True)
        e = results[str(length)] = long_entry(ours_s, hf_s, tok_ours, tok_hf, cached_s, lone_s)
        print(f"  {dtype} {length} tokens: first token ours {tok_ours} {_text(tokenizer, tok_ours)}, "
              f"transformers {tok_hf} {_text(tokenizer, tok_hf)}: "
              f"{'same' if e['same_first_token'] else 'DIFFERENT'}", flush=True)
    return results


def _text(tokenizer, token: int | None) -> str:
    return "" if token is None or tokenizer is None else repr(tokenizer.decode([token]))
