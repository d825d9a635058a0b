"""The capacity planner's memory arithmetic (docs/design.md, 'Memory arithmetic')."""
from __future__ import annotations

import pytest

from jupyter_pagedkv.sim.plan import GiB, MODELS, plan


def test_kv_bytes_per_token_counts_kv_heads_not_query_heads():
    assert MODELS["Llama-3-70B"].kv_bytes_per_token(2) == 327_680            # 320 KiB in fp16
    assert MODELS["Llama-3-70B"].kv_bytes_per_token(2) * 8192 == 2.5 * GiB
    assert MODELS["SmolLM2-135M"].kv_bytes_per_token(4) == 46_080            # fp32


def test_model_shape_from_a_config_matches_the_preset(embedded):
    from jupyter_pagedkv.sim.plan import ModelShape

    model, _ = embedded
    shape = ModelShape.from_config(model.config)
    assert shape.kv_bytes_per_token(4) == MODELS["SmolLM2-135M"].kv_bytes_per_token(4)


def test_paging_holds_more_requests_than_contiguous_reservation():
    p = plan("Llama-3-8B", "A100-80GB", context_len=1000)
    assert p.fits and p.tokens % 16 == 0
    assert p.paged_concurrency == p.tokens // 1008
    assert p.contiguous_concurrency == p.tokens // 8192
    assert p.paged_concurrency > 7 * p.contiguous_concurrency


def test_a_model_too_big_for_the_gpu_says_what_to_do():
    p = plan("Llama-3-70B", "H100-80GB")
    assert not p.fits and p.tokens == 0
    assert "tensor parallel" in p.summary()
    assert plan("Llama-3-70B", "H100-80GB", num_gpus=2).fits


def test_unknown_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown GPU"):
        plan("Llama-3-8B", "Z80")


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_the_planner_counts_a_quantized_cache_as_the_engine_allocates_it(kind):
    """The planner's bytes per token with a KV dtype are the engine's own (worker/kv_cache.py's
    KVSpec, scales included), and the same GPU holds >= 1.9x the bf16 tokens."""
    import torch

    from jupyter_pagedkv.sim.plan import MODELS
    from jupyter_pagedkv.worker.kv_cache import KVSpec

    m = MODELS["Llama-3-8B"]
    spec = KVSpec(m.num_layers, m.num_kv_heads, m.head_dim, torch.bfloat16, kind)
    quant, dense = plan("Llama-3-8B", kv_cache_dtype=kind), plan("Llama-3-8B")
    assert quant.kv_bytes_per_token == spec.bytes_per_token
    assert quant.tokens >= 1.9 * dense.tokens
    assert f"KV per token ({kind})" in quant.summary()
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        plan("Llama-3-8B", kv_cache_dtype="fp4")
