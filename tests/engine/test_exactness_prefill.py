"""Long prompts through the new prefill attention are exact against transformers' `generate`:
chunked at several budgets (so chunks start after prefixes, at block-aligned and unaligned
positions), again over a cached prefix (the same prompt plus a few new tokens), with a sliding
window that cuts, in fp32 and bf16. The `-gqa64` models have heads of 64 with three query heads
per KV head (SmolLM2's shape), which the C++ prefill kernel serves where the CPU has AVX-512; the
others run torch's SDPA. The Triton backend's version runs in tests/worker/test_kernels.py."""
from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.testing.models import compare_with_oracle, random_prompts
from jupyter_pagedkv.worker import prefill_attention
from jupyter_pagedkv.worker.plan import decide_prefill_attention

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
BUDGETS = (37, 128)        # chunks start at unaligned (37) and block-aligned (128) positions
ARCHS = ["llama", "mistral-window48", "llama-gqa64", "mistral-window48-gqa64"]


def run_cold_then_cached(make_engine, model, prompt, budget):
    """The prompt on an empty cache, then the prompt plus 11 tokens over its cached blocks."""
    engine = make_engine(model, block_size=4, max_num_batched_tokens=budget)
    head_dim = model.config.head_dim
    _, kernel = decide_prefill_attention("auto", engine.device, "torch", engine.dtype, head_dim)
    assert (engine._runner.prefill_kernel is not None) == (kernel is not None)
    assert (kernel is not None) <= (head_dim == 64)     # the kernel serves only the -gqa64 models here
    with mock.patch.object(prefill_attention, "attend", wraps=prefill_attention.attend) as kernel_calls:
        cold = engine.generate([prompt], GREEDY)[0]
        longer = prompt + random_prompts(1, 256, seed=len(prompt), lo=11, hi=12)[0]
        warm = engine.generate([longer], GREEDY)[0]
    assert (kernel_calls.call_count > 0) == (kernel is not None)
    assert warm.num_cached_tokens >= len(prompt) - 4        # all but the partly filled last block
    return [(prompt, cold.outputs[0].token_ids), (longer, warm.outputs[0].token_ids)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_long_prompt_chunked_and_over_a_cached_prefix_is_exact(make_engine, arch, budget):
    model = tiny_model(arch, seed=23)
    prompt = random_prompts(1, 256, seed=budget, lo=440, hi=480)[0]
    runs = run_cold_then_cached(make_engine, model, prompt, budget)
    identical = [assert_same_or_near_tie(model, p, ours, hf_greedy(model, p, NEW, stop_at_eos=False))
                 for p, ours in runs]
    assert any(identical)


def bf16_step(logit: float) -> float:
    """The spacing of bf16 numbers around `logit` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(logit))) - 7) if logit else 2.0 ** -133


@pytest.mark.parametrize("arch", ARCHS)
def test_long_prompt_in_bf16_parts_from_transformers_only_at_a_bf16_near_tie(make_engine, arch):
    model = tiny_model(arch, seed=24).to(torch.bfloat16)
    same = 0
    prompt = random_prompts(1, 256, seed=38, lo=440, hi=480)[0]
    for p, ours in run_cold_then_cached(make_engine, model, prompt, 37):
        found = compare_with_oracle(model, p, ours, hf_greedy(model, p, NEW, stop_at_eos=False))
        same += found.identical
        assert found.identical or found.gap <= 2 * bf16_step(found.top), (found.index, found.gap)
    assert same >= 1
