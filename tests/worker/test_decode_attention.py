"""The C++ paged decode attention (worker/decode_attention.cpp): each decode row attends over its
own blocks where they lie. Checked against attention written out in float64 from the slots the
block table names, never against our own earlier output."""
from __future__ import annotations

import pytest
import torch
from kv_codes import dequantize, quantized_cache

from jupyter_pagedkv.worker.native_decode import load_extension
from jupyter_pagedkv.worker.plan import decide_decode_attention

BLOCK = 16


@pytest.fixture(scope="module")
def kernel():
    return load_extension()


def case(dtype, heads=9, kv_heads=3, d=64, lens=(1, 16, 17, 40, 95), blocks=40, seed=0):
    """A cache of `blocks` random blocks, rows whose block tables are random permutations."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, BLOCK, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(blocks, BLOCK, kv_heads, d, generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    width = -(-max(lens) // BLOCK)
    table = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens]).long()
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, k, v, table, lens_t


def reference(q, k, v, table, lens, scale, window=0) -> torch.Tensor:
    """Softmax attention in float64 over each row's visible positions, slot by slot."""
    rows, heads, d = q.shape
    group = heads // k.shape[2]
    out = torch.empty(rows, heads, d, dtype=torch.float64)
    for r in range(rows):
        n = int(lens[r])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blocks = table[r, pos // BLOCK]
        keys = k[blocks, pos % BLOCK].double().repeat_interleave(group, dim=1)     # [n, heads, d]
        values = v[blocks, pos % BLOCK].double().repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[r].double(), keys) * scale).softmax(-1)
        out[r] = torch.einsum("hn,nhd->hd", weights, values)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 128), (8, 2, 40)])
@pytest.mark.parametrize("window", [0, 5, 16, 33])
def test_matches_attention_written_out_in_float64(kernel, dtype, tol, heads, kv_heads, d, window):
    q, k, v, table, lens = case(dtype, heads, kv_heads, d)
    out = kernel.paged_decode_attention(q, k, v, table, lens, d ** -0.5, window)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, table, lens, d ** -0.5, window), atol=tol, rtol=tol)


def test_reads_a_query_sliced_from_packed_projections(kernel):
    """The loops pass q as a view of the packed q/k/v output (rows strided past k and v)."""
    q, k, v, table, lens = case(torch.float32)
    packed = torch.cat([q, torch.randn(q.shape[0], 6, q.shape[2])], dim=1)
    view = packed[:, :q.shape[1]]
    assert not view.is_contiguous()
    assert torch.equal(kernel.paged_decode_attention(view, k, v, table, lens, 0.125, 0),
                       kernel.paged_decode_attention(q, k, v, table, lens, 0.125, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d, window", [(9, 3, 64, 0), (4, 4, 128, 33), (8, 1, 64, 21),
                                                        (16, 2, 128, 0), (8, 2, 40, 0)])
def test_a_rows_result_depends_on_nothing_but_the_row(kernel, dtype, heads, kv_heads, d, window):
    """Not on the other rows of the batch, the thread count, or the CPU's vector width (AVX-512's
    16-key path for head sizes 64 and 128, windowed or not, against AVX2's and the baseline's
    key-by-key loops)."""
    q, k, v, table, lens = case(dtype, heads, kv_heads, d, lens=(3, 70, 95, 18, 50, 1, 64, 33))
    batch = kernel.paged_decode_attention(q, k, v, table, lens, 0.125, window)
    for r in (0, 2, 5):
        alone = kernel.paged_decode_attention(q[r:r + 1], k, v, table[r:r + 1], lens[r:r + 1], 0.125, window)
        assert torch.equal(alone[0], batch[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.paged_decode_attention(q, k, v, table, lens, 0.125, window), batch)
    finally:
        torch.set_num_threads(threads)
    for isa in ("avx512", "avx2", "generic"):
        assert torch.equal(kernel.paged_decode_attention_isa(q, k, v, table, lens, 0.125, window, isa), batch), isa


def test_bad_arguments_get_one_line_errors(kernel):
    q, k, v, table, lens = case(torch.float32)
    with pytest.raises(RuntimeError, match="int64 block table and int32 lengths"):
        kernel.paged_decode_attention(q, k, v, table.int(), lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="in the query's dtype"):
        kernel.paged_decode_attention(q.double(), k, v, table, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="GQA grouping"):
        kernel.paged_decode_attention(q[:, :8], k, v, table, lens, 0.125, 0)


def test_the_engine_option_chooses_the_kernel_or_sdpa():
    cpu = torch.device("cpu")
    assert decide_decode_attention("auto", cpu, "torch")[1] is load_extension().paged_decode_attention
    assert decide_decode_attention("torch", cpu, "torch")[1] is None
    assert decide_decode_attention("auto", cpu, "triton")[1] is None
    with pytest.raises(ValueError, match="decode_attention='native' runs on the CPU with the torch attention "
                                         "backend only .*use 'auto'"):
        decide_decode_attention("native", cpu, "triton")


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads, d, window", [(9, 3, 64, 0), (4, 4, 128, 16), (8, 2, 40, 5)])
def test_a_quantized_cache_is_read_as_its_dequantized_values(kernel, kind, dtype, tol, heads, kv_heads, d, window):
    """int8 / fp8 codes with fp16 scales per token and KV head: the kernel attends over code *
    scale, checked against the float64 reference over the dequantized cache (partial last blocks,
    GQA, a window, head sizes with and without a compiled-in size); every ISA variant agrees."""
    q, k, v, table, lens = case(dtype, heads, kv_heads, d)
    kq, vq, ks, vs = quantized_cache(k.float(), v.float(), kind)
    out = kernel.paged_decode_attention(q, kq, vq, table, lens, d ** -0.5, window, ks, vs)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, dequantize(kq, ks), dequantize(vq, vs), table, lens, d ** -0.5, window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    for isa in ("avx512", "avx2", "generic"):
        assert torch.equal(kernel.paged_decode_attention_isa(q, kq, vq, table, lens, d ** -0.5, window, isa, ks, vs),
                           out), isa


def test_every_finite_fp8_code_widens_exactly(kernel):
    """One key, weight 1: the output is the value row itself, so each of the 254 finite e4m3 codes
    (both NaN codes excluded) must come out as torch's own widening of it, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    v = codes.view(torch.float8_e4m3fn).view(1, 1, 4, 64)
    k = torch.zeros_like(v)
    ones = torch.ones(1, 1, 4, dtype=torch.float16)
    table, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    out = kernel.paged_decode_attention(torch.randn(1, 4, 64), k, v, table, lens, 0.125, 0, ones, ones)
    assert torch.equal(out.view(-1), v.float().view(-1))


def test_a_quantized_cache_without_its_scales_is_refused(kernel):
    q, k, v, table, lens = case(torch.float32)
    kq, vq, ks, vs = quantized_cache(k, v, "int8")
    with pytest.raises(RuntimeError, match="takes k_scale and v_scale"):
        kernel.paged_decode_attention(q, kq, vq, table, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="float16 scales"):
        kernel.paged_decode_attention(q, kq, vq, table, lens, 0.125, 0, ks.float(), vs.float())
