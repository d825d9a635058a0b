"""A quantized KV cache (kv_cache_dtype "fp8_e4m3", "int8") through the engine's kernels: the C++
decode and prefill kernels and the C++ decode loop, chosen by the plan as for a model-dtype cache,
give the tokens of the torch path (SDPA over the dequantized blocks, every step in the model's own
forward), and the one backend that cannot read fp8 (Triton before sm_89) says so in one line."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.testing.models import random_prompts
from jupyter_pagedkv.worker.packed_linear import packable_dtypes
from jupyter_pagedkv.worker.plan import KERNEL_KV_DTYPES, decide_backend, kv_dtype_problem

MODEL = tiny_model("llama-gqa64", seed=3)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(3, 256, seed=7, lo=20, hi=50)
QUANTIZED = ("fp8_e4m3", "int8")


@pytest.mark.parametrize("kind", QUANTIZED)
def test_the_cpp_kernels_read_a_quantized_cache_and_give_the_torch_paths_tokens(make_engine, kind):
    options = dict(block_size=4, max_num_batched_tokens=16, kv_cache_dtype=kind)     # chunked prefill
    torch_path = make_engine(MODEL, decode_attention="torch", prefill_attention="torch", step_loop="model",
                             **options)
    expected = [o.token_ids for o in torch_path.generate(PROMPTS, GREEDY)]
    engine = make_engine(MODEL, **options)                                           # every choice "auto"
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected
    plan = engine._runner.plan
    assert plan.decode_attention.choice == "native", plan.decode_attention
    # the cache is written in C++ (kv_quantize.cpp) beside the C++ decode kernel; the torch path's
    # engine writes with kv_quant's ATen ops, so the tokens' equality checks the two writes too
    assert engine._runner.kv_write is not None and torch_path._runner.kv_write is None
    # the prefill kernel needs AVX-512 (fp32): elsewhere the plan says so and SDPA runs
    assert plan.prefill_attention.choice == "native" or "AVX-512" in plan.prefill_attention.reason
    loop = engine._runner.lean.native if engine._runner.lean is not None else None
    if MODEL.dtype in packable_dtypes():        # the C++ decode loop, proven bit for bit on its first step
        assert loop is not None and loop.proven and loop.enabled, plan.forward


@pytest.mark.parametrize("kind", QUANTIZED)
def test_every_kernel_reads_every_kv_dtype(kind):
    assert all(kv_dtype_problem(kernel, kind) is None for kernel in KERNEL_KV_DTYPES)


def test_fp8_on_the_triton_backend_before_sm89_is_one_line_naming_int8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    with pytest.raises(ValueError) as err:
        decide_backend(cuda, "triton", "fp8_e4m3")
    message = str(err.value)
    assert "\n" not in message and "sm_80" in message and "'int8'" in message and "attention_backend='torch'" in message
    assert kv_dtype_problem("triton", "int8", cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kv_dtype_problem("triton", "fp8_e4m3", cuda) is None
