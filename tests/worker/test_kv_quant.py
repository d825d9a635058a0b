"""The quantized KV cache's format (worker/kv_quant.py): round-trip error bounds, zeros, extremes;
whole-block copies, swaps and forks carry the scales; the same memory holds ~2x the blocks."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from jupyter_pagedkv.testing.models import SHAPES
from jupyter_pagedkv.worker.kv_cache import KVCache, KVSpec
from jupyter_pagedkv.worker.kv_quant import dequantize, quantize

QUANTIZED = ("fp8_e4m3", "int8")


def rows(seed: int) -> torch.Tensor:
    """Rows of head_dim 64 over six orders of magnitude, with outliers: K/V's real spread."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 64, generator=g) * torch.logspace(-4, 2, 64).view(64, 1, 1)
    x[::7, :, 5] *= 30.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_is_within_e4m3_rounding(dtype):
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a subnormal
    (below 2^-6 of the scale unit) by at most 2^-10 scale units; plus the compute dtype's rounding."""
    x = rows(0).to(dtype)
    q, scale = quantize(x, "fp8_e4m3")
    back = dequantize(q, scale, dtype).float()
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float16 and scale.shape == x.shape[:-1]
    xf = x.float()
    bound = xf.abs() * 2 ** -4 + scale.float().unsqueeze(-1) * 2 ** -10
    bound = bound * (1 + torch.finfo(dtype).eps) + xf.abs() * torch.finfo(dtype).eps
    assert bool(((back - xf).abs() <= bound).all())


def test_int8_round_trip_is_within_half_a_step():
    x = rows(1)
    q, scale = quantize(x, "int8")
    back = dequantize(q, scale, torch.float32)
    step = scale.float().unsqueeze(-1)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("kind", QUANTIZED)
def test_zeros_stay_zero_and_huge_values_saturate_without_nan(kind):
    x = torch.zeros(2, 4, 64)
    x[1, 2] = 6.0e4
    x[1, 3, 0] = -3.0e4
    q, scale = quantize(x, kind)
    back = dequantize(q, scale, torch.float32)
    assert torch.equal(back[0], x[0]) and torch.equal(back[1, :2], x[1, :2])
    assert bool(torch.isfinite(back).all())
    assert torch.allclose(back[1, 2:], x[1, 2:], rtol=2 ** -4)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_copies_swaps_and_forks_carry_the_scales(kind):
    cache = KVCache(KVSpec(2, 2, 8, torch.bfloat16, kind), num_blocks=6, block_size=4)
    assert cache.k.dtype == dict(fp8_e4m3=torch.float8_e4m3fn, int8=torch.int8)[kind]
    assert cache.k_scale.shape == (2, 6, 4, 2) and cache.layer_scales(1)[0].shape == (6, 4, 2)
    for t, s in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        q, scale = quantize(torch.randn(t.shape), kind)
        t.copy_(q)
        s.copy_(scale)
    read = lambda blocks: [dequantize(t[:, blocks], s[:, blocks], torch.float32)
                           for t, s in ((cache.k, cache.k_scale), (cache.v, cache.v_scale))]
    before = read([1, 4])
    cache.copy_blocks([(1, 0), (4, 5)])                     # copy-on-write / fork
    assert all(torch.equal(a, b) for a, b in zip(read([0, 5]), before))
    cache.allocate_swap(3)
    cache.swap_out([(1, 2), (4, 0)])
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        t.zero_()
    cache.swap_in([(2, 3), (0, 2)])
    assert all(torch.equal(a, b) for a, b in zip(read([3, 2]), before))


@pytest.mark.parametrize("kind", QUANTIZED)
def test_the_same_memory_holds_at_least_1_9x_the_blocks_for_smollm2(kind):
    """SmolLM2-135M's shapes (30 layers, 3 KV heads of 64) in bf16: 128 bytes per token and head
    against 64 + a 2-byte scale = 1.94x the blocks per GiB; counted by the spec, checked on a cache."""
    spec = KVSpec.from_config(tf.LlamaConfig(**SHAPES["smollm2-135m"]), torch.bfloat16)
    quant = KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.bfloat16, kind)
    per_gib = lambda s: (1 << 30) // (s.bytes_per_token * 16)
    assert per_gib(quant) >= 1.9 * per_gib(spec)
    small = KVCache(KVSpec(2, 3, 64, torch.bfloat16, kind), num_blocks=5, block_size=16)
    assert small.nbytes == 5 * small.bytes_per_block      # what is counted is what is allocated
