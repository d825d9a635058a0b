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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_keeps_the_scale_whose_codes_read_back_nearest(dtype):
    """The searched scale lies between absmax / 448 and 1.9375 x that (each rounded to float16,
    floored at its smallest normal), so no code clips but by float16's rounding of the scale, and
    no row reads back worse than under absmax / 448 alone, the scale before the search; over these
    rows it is better by a margin."""
    x = rows(2).to(dtype)
    xf = x.float()
    q, scale = quantize(x, "fp8_e4m3")
    unit = xf.abs().amax(-1) / 448
    lo, hi = (s.clamp(min=2.0 ** -14).half().float() for s in (unit, unit * 1.9375))
    assert bool(((lo <= scale.float()) & (scale.float() <= hi)).all())
    assert bool((scale.float() > lo).any())                 # the search moved some scales
    plain = lo.unsqueeze(-1)
    plain_back = (xf / plain).clamp(-448, 448).to(torch.float8_e4m3fn).float() * plain
    error = (dequantize(q, scale, torch.float32).double() - xf.double()).square().sum(-1)
    plain_error = (plain_back.double() - xf.double()).square().sum(-1)
    assert bool((error <= plain_error).all())
    assert float(error.sum()) < 0.9 * float(plain_error.sum())


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


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vector_builds", [True, False], ids=["vector", "baseline"])
def test_the_cpp_write_stores_the_formats_codes_and_scales_bit_for_bit(kind, dtype, head_dim, vector_builds):
    """native_decode.cpp's write_quantized (fp8: kv_quantize.cpp's one-pass scale search), which the
    engine's CPU steps write with wherever the C++ decode kernel is loaded, against the format
    written out independently (tests/kv_codes.py): rows over seven decades, zeros, -0, e4m3
    subnormals, an infinity, a NaN, strided rows as the engine passes them; head sizes the kernel
    fixes at compile time (64, 128) and one it reads at run time; its vector and baseline builds;
    unwritten slots keep their bytes."""
    from kv_codes import quantize as definition

    from jupyter_pagedkv.worker.native_decode import load_extension

    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(3, 128, head_dim, generator=g) * torch.logspace(-4, 2, 128).view(1, 128, 1)
    x = x.to(dtype).transpose(0, 1)                                   # [128, 3, d], strided
    x[0, 0] = 0
    x[1, 1] = -0.0
    x[2, 2] = (torch.logspace(-7, 0, head_dim) * torch.randn(head_dim, generator=g).sign()).to(dtype)
    x[3, 0, 7] = float("inf")
    x[4, 1, 2] = float("nan")
    codes, scales = definition(x, kind)
    cache = torch.full((12, 16, 3, head_dim), 7, dtype=torch.uint8).view(codes.dtype)
    cache_scales = torch.full((12, 16, 3), 0.5, dtype=torch.float16)
    slots = torch.randperm(12 * 16, generator=torch.Generator().manual_seed(6))[:128]
    module = load_extension()
    before = module.row_loops_avx2(vector_builds)
    try:
        module.write_quantized(cache, cache_scales, x, slots)
    finally:
        module.row_loops_avx2(before)
    flat, flat_scales = cache.view(torch.uint8).view(-1, 3, head_dim), cache_scales.view(-1, 3)
    assert torch.equal(flat[slots], codes.view(torch.uint8))
    assert torch.equal(flat_scales[slots].view(torch.int16), scales.view(torch.int16))     # NaN's bits too
    untouched = torch.ones(12 * 16, dtype=torch.bool)
    untouched[slots] = False
    assert bool((flat[untouched] == 7).all() and (flat_scales[untouched] == 0.5).all())


def test_the_cpp_write_refuses_a_cache_it_cannot_hold_in_one_line():
    from jupyter_pagedkv.worker.native_decode import load_extension

    cache = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="write_quantized: an int8 or float8_e4m3fn cache layer"):
        load_extension().write_quantized(cache, torch.zeros(4, 16, 3, dtype=torch.float16),
                                         torch.zeros(2, 3, 64), torch.tensor([0, 1]))
